"""The atlas's models (docs/what-fits.md): 40 of timm's most used, one home for bench_atlas.py and the GPU tables'
row selection (bench_gpu_tables.py keeps every decayed row of these)."""

MODELS = (
    'resnet18', 'resnet34', 'resnet50', 'resnet101', 'resnet152', 'resnet50d', 'resnet101d', 'resnext50_32x4d',
    'seresnext50_32x4d', 'wide_resnet50_2', 'efficientnet_b0', 'efficientnet_b3', 'tf_efficientnetv2_s',
    'tf_efficientnetv2_m', 'convnext_tiny', 'convnext_small', 'convnext_base', 'convnextv2_tiny',
    'vit_tiny_patch16_224', 'vit_small_patch16_224', 'vit_base_patch16_224', 'vit_large_patch16_224',
    'deit_small_patch16_224', 'deit_base_patch16_224', 'eva02_small_patch14_224', 'swin_tiny_patch4_window7_224',
    'swin_base_patch4_window7_224', 'regnety_040', 'regnety_160', 'regnetx_064', 'mobilenetv3_large_100',
    'mobilenetv4_conv_medium', 'maxvit_tiny_tf_224', 'caformer_s18', 'caformer_b36', 'inception_v3', 'densenet121',
    'efficientvit_b2', 'levit_256', 'edgenext_small',
)
