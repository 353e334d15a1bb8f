"""Every environment variable and on-disk location localinfer uses, read in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from localinfer.errors import UsageError
from localinfer.units import parse_size

APP_NAME = "localinfer"
# Piped input read at most: 16 MB of text is some 4 million tokens, past any model's context.
DEFAULT_STDIN_BYTES = 16_000_000


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
    stdin_cap: str = ""        # LOCALINFER_STDIN_BYTES: the most piped input `run` reads
    rpc: str = ""              # LOCALINFER_RPC: workers to compute on, as --rpc takes them

    @property
    def data_dir(self) -> Path:
        if self.home:
            return _checked_home(self.home) / "data"
        return Path(platformdirs.user_data_dir(APP_NAME))

    @property
    def config_dir(self) -> Path:
        if self.home:
            return _checked_home(self.home) / "config"
        return Path(platformdirs.user_config_dir(APP_NAME))

    @property
    def cache_dir(self) -> Path:
        if self.home:
            return _checked_home(self.home) / "cache"
        return Path(platformdirs.user_cache_dir(APP_NAME))

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def user_catalogue(self) -> Path:
        return self.config_dir / "models.toml"

    @property
    def user_config(self) -> Path:
        """The user's own option defaults (`[defaults]`, `[defaults.MODEL]`), beside models.toml."""
        return self.config_dir / "config.toml"

    @property
    def prompt_cache_dir(self) -> Path:
        return self.cache_dir / "prompts"

    @property
    def prompt_cache_bytes(self) -> int | None:
        """The cap set by LOCALINFER_PROMPT_CACHE_BYTES (e.g. 2000000000, 500M, 2G), or None.

        Parsed on use, not at load, so a bad value is a one-line usage error of the command.
        """
        return parse_size(self.prompt_cache_cap, "LOCALINFER_PROMPT_CACHE_BYTES") if self.prompt_cache_cap.strip() else None

    @property
    def stdin_bytes(self) -> int:
        """The most piped input `run` reads (LOCALINFER_STDIN_BYTES, e.g. 64M)."""
        if not self.stdin_cap.strip():
            return DEFAULT_STDIN_BYTES
        return parse_size(self.stdin_cap, "LOCALINFER_STDIN_BYTES")

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
        stdin_cap=os.environ.get("LOCALINFER_STDIN_BYTES", ""),
        rpc=os.environ.get("LOCALINFER_RPC", ""),
    )


def _checked_home(home: Path) -> Path:
    """LOCALINFER_HOME, once it is known to be a directory or a place where one can be made: a file
    there (or above it) would otherwise fail deep inside whichever command first writes."""
    for path in (home, *home.parents):     # the nearest part that exists must be a directory
        try:
            exists = path.exists()
        except OSError:                     # e.g. a name too long: creating it will say so
            break
        if exists and not path.is_dir():
            raise UsageError(f"LOCALINFER_HOME={home} is not a directory ({path} is a file); "
                             "point it at a directory, or at a path where one can be made")
        if exists:
            break
    return home
