"""`--image`, `--audio` and `--mmproj`: the media read and checked, and the model's projector
found, before anything is pulled or loaded (docs/multimodal.md)."""

from __future__ import annotations

import typer

from localinfer.errors import UsageError

MEDIA = "Images and audio"


def image_option():
    return typer.Option([], "--image", metavar="FILE", rich_help_panel=MEDIA,
                        help="An image for the prompt (repeatable; - = stdin).")


def audio_option():
    return typer.Option([], "--audio", metavar="FILE", rich_help_panel=MEDIA,
                        help="An audio clip for the prompt (repeatable).")


def mmproj_option():
    return typer.Option(None, "--mmproj", metavar="FILE", rich_help_panel=MEDIA,
                        help="Projector file (default: mmproj*.gguf beside).")


def read(images: list[str], audio: list[str]) -> tuple:
    """The media as given, checked (localinfer.media): images first, then audio; at most one
    from stdin."""
    from localinfer import media
    if [*images, *audio].count("-") > 1:
        raise UsageError("only one image or clip can come from stdin ('-')")
    media.count_ok(len(images) + len(audio), "the command line")
    return (*(media.read_path(p, "image") for p in images),
            *(media.read_path(p, "audio") for p in audio))


def uses_stdin(images: list[str], audio: list[str]) -> bool:
    return "-" in images or "-" in audio
