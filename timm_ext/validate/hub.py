"""Can a model's pretrained weights be had right now? Answer before timm tries and retries a download.

Offline, `timm.create_model(name, pretrained=True)` spends about a minute in the hub client's retries and ends in a
long traceback. `pretrained_unavailable` answers in a few seconds: weights in the local cache (Hugging Face hub
or torch.hub) are available; otherwise the weights host must accept a connection.
"""
import functools
import os
import socket
from typing import Optional
from urllib.parse import urlparse

import torch

__all__ = ['pretrained_unavailable', 'is_download_error']

_HF_WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin', 'open_clip_model.safetensors',
                    'open_clip_pytorch_model.bin')


def _hf_cached(repo_id: str, filename: Optional[str]) -> bool:
    from huggingface_hub import try_to_load_from_cache
    repo_id, _, revision = repo_id.partition('@')
    names = ((filename,) if filename else ()) + _HF_WEIGHT_FILES
    return any(isinstance(try_to_load_from_cache(repo_id, n, revision=revision or None), str) for n in names)


def _url_cached(url: str) -> bool:
    name = os.path.basename(urlparse(url).path)
    return bool(name) and os.path.isfile(os.path.join(torch.hub.get_dir(), 'checkpoints', name))


def _unreachable(url: str, timeout: float) -> Optional[str]:
    parts = urlparse(url)
    if not parts.hostname:
        return None
    return _host_unreachable(parts.hostname, parts.port or (443 if parts.scheme == 'https' else 80), timeout)


@functools.lru_cache(maxsize=None)  # one answer per host and run: bulk mode asks for every model
def _host_unreachable(host: str, port: int, timeout: float) -> Optional[str]:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f'{host} cannot be reached ({e.strerror or type(e).__name__})'
    return None


def pretrained_unavailable(model_name: str, timeout: float = 3.0) -> Optional[str]:
    """Say why `model_name`'s pretrained weights cannot be loaded now, or return None when they can (or may).

    Args:
        model_name: timm model name, optionally with a pretrained tag (`resnet50.a1_in1k`).
        timeout: Seconds to wait for the weights host to accept a connection.

    Returns:
        None when the weights are cached, come from a local file, or their host answers; otherwise a short reason
        such as 'huggingface.co cannot be reached (Name or service not known)'.
    """
    from timm.models import get_pretrained_cfg
    cfg = get_pretrained_cfg(model_name)
    if cfg is None:
        return None  # timm decides (random init with a warning, or its own error)
    if cfg.file or cfg.state_dict:
        return None
    if cfg.hf_hub_id:
        if _hf_cached(cfg.hf_hub_id, cfg.hf_hub_filename):
            return None
        from huggingface_hub import constants
        if constants.HF_HUB_OFFLINE:
            return 'HF_HUB_OFFLINE is set'
        return _unreachable(constants.ENDPOINT, timeout)
    if cfg.url:
        return None if _url_cached(cfg.url) else _unreachable(cfg.url, timeout)
    return None


def is_download_error(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) is a failed weights download: no network, host down, offline mode."""
    import urllib.error
    from ..oom import _exception_chain
    return any(isinstance(e, (ConnectionError, TimeoutError, socket.gaierror, urllib.error.URLError))
               or type(e).__module__.startswith(('huggingface_hub', 'requests', 'httpx', 'urllib3'))
               for e in _exception_chain(exc))
