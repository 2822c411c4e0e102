"""timm_ext: batch-size tooling for timm training and validation scripts."""
__version__ = '0.1.0'
