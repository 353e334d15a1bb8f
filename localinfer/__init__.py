"""localinfer: run language models locally, as fast as the hardware allows.

    import localinfer
    with localinfer.load("smollm2") as model:
        print(model.generate("Why is the sky blue?", temperature=0))

`load` and `Model` are the Python API under the `localinfer` command (docs/python.md). They are
imported on first use: `import localinfer` loads no engine and no terminal library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["load", "Model", "LocalinferError", "__version__"]

if TYPE_CHECKING:
    from localinfer.api import Model, load
    from localinfer.errors import LocalinferError


def __getattr__(name: str) -> Any:
    if name in ("load", "Model"):
        from localinfer import api
        return getattr(api, name)
    if name == "LocalinferError":
        from localinfer.errors import LocalinferError
        return LocalinferError
    raise AttributeError(f"module 'localinfer' has no attribute {name!r}")
