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
    def chat_history(self) -> Path:
        return self.data_dir / "chat_history"


def load() -> Settings:
    home = os.environ.get("LOCALINFER_HOME")
    return Settings(
        home=Path(home).expanduser() if home else None,
        no_color="NO_COLOR" in os.environ and os.environ["NO_COLOR"] != "",
        debug=os.environ.get("LOCALINFER_DEBUG", "") not in ("", "0"),
    )
