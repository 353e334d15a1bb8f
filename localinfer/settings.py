"""Every environment variable and on-disk location localinfer uses, read in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

APP_NAME = "localinfer"


@dataclass(frozen=True)
class Settings:
    home: Path | None          # LOCALINFER_HOME: everything under one directory
    no_color: bool             # NO_COLOR: no colour anywhere, whatever the terminal
    debug: bool                # LOCALINFER_DEBUG: tracebacks on errors
    prompt_cache_cap: str = ""  # LOCALINFER_PROMPT_CACHE_BYTES: byte cap of the prompt cache; 0 = off
    memory_budget: str | None = None   # LOCALINFER_MEMORY_BUDGET: e.g. "6GB", overrides detection
    # LLAMA_CPP_LIB_PATH: llama-cpp-python's own override of its library folder; the quantizer's
    # direct binding then leaves the loading to the package.
    engine_lib_dir: str | None = None

    @property
    def data_dir(self) -> Path:
        if self.home:
            return self.home / "data"
        return Path(platformdirs.user_data_dir(APP_NAME))

    @property
    def config_dir(self) -> Path:
        if self.home:
            return self.home / "config"
        return Path(platformdirs.user_config_dir(APP_NAME))

    @property
    def cache_dir(self) -> Path:
        if self.home:
            return self.home / "cache"
        return Path(platformdirs.user_cache_dir(APP_NAME))

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def user_catalogue(self) -> Path:
        return self.config_dir / "models.toml"

    @property
    def prompt_cache_dir(self) -> Path:
        return self.cache_dir / "prompts"

    @property
    def prompt_cache_bytes(self) -> int | None:
        """The cap set by LOCALINFER_PROMPT_CACHE_BYTES (e.g. 2000000000, 500M, 2G), or None.

        Parsed on use, not at load, so a bad value is a one-line usage error of the command.
        """
        return parse_bytes(self.prompt_cache_cap) if self.prompt_cache_cap.strip() else None

    @property
    def chat_history(self) -> Path:
        return self.data_dir / "chat_history"


def load() -> Settings:
    home = os.environ.get("LOCALINFER_HOME")
    return Settings(
        home=Path(home).expanduser() if home else None,
        no_color="NO_COLOR" in os.environ and os.environ["NO_COLOR"] != "",
        debug=os.environ.get("LOCALINFER_DEBUG", "") not in ("", "0"),
        prompt_cache_cap=os.environ.get("LOCALINFER_PROMPT_CACHE_BYTES", ""),
        memory_budget=os.environ.get("LOCALINFER_MEMORY_BUDGET") or None,
        engine_lib_dir=os.environ.get("LLAMA_CPP_LIB_PATH") or None,
    )


_UNITS = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30}


def parse_bytes(text: str) -> int:
    """'500M', '2G', '1GiB' or a plain number of bytes."""
    from localinfer.errors import UsageError
    value = text.strip().upper().removesuffix("B")
    digits = value.rstrip("KMGI")
    unit = value[len(digits):]
    try:
        number = float(digits)
    except ValueError:
        number = -1.0
    if unit not in _UNITS or number < 0:
        raise UsageError(f"LOCALINFER_PROMPT_CACHE_BYTES={text!r} is not a size; use e.g. 2G, 500M or 0")
    return int(number * _UNITS[unit])
