"""Images and audio in a chat request, from every API `serve` speaks, as Media values in the
order of the conversation (docs/multimodal.md, "APIs").

Every dialect says its media as OpenAI's content parts (`image_part`, `audio_part`), carrying the
name of the field in its own API's terms for the errors; requests.py's message parsing hands each
part to a Reader, which checks it (localinfer/media: header checks before any decoding) and puts
media.MARKER in the message's text where it goes. The parts are counted before any is decoded, so
a request of 1,000 images is refused without reading one. A remote http(s) URL is fetched only
when serve was started with --allow-remote-media.
"""

from __future__ import annotations

from localinfer.media import (MARKER, Media, MediaError, count_ok, from_base64, from_data_url,
                              is_data_url)
from localinfer.media.remote import fetch, is_remote
from localinfer.server.errors import BadRequest

IMAGE, AUDIO = "image_url", "input_audio"
KINDS = (IMAGE, AUDIO)
WHERE = "localinfer_where"      # a translated part's field in its own API's terms
_AUDIO_FORMATS = ("wav", "mp3", "flac")


def image_part(url: str, where: str) -> dict:
    """OpenAI's image_url part for another API's image (a data: or http(s) URL, or base64)."""
    return {"type": IMAGE, IMAGE: {"url": url}, WHERE: where}


def audio_part(data: str, fmt: str, where: str) -> dict:
    return {"type": AUDIO, AUDIO: {"data": data, "format": fmt}, WHERE: where}


def responses_part(part, where: str) -> dict | None:
    """The Responses API's input_image or input_audio part as OpenAI's chat part; None for
    any other part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_image":
        if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
            raise BadRequest(f"{where}: an input_image needs image_url (a data: URL); files "
                             "are not kept here", "input")
        return image_part(part["image_url"], where)
    if kind == "input_audio":
        said = part.get("input_audio")
        if not isinstance(said, dict):
            raise BadRequest(f"{where}.input_audio needs data (base64) and format", "input")
        return audio_part(said.get("data"), said.get("format"), where)
    return None


_PARTS = {IMAGE: "images", "image": "images", "input_image": "images", AUDIO: "audio"}


def asked(body: dict) -> str | None:
    """"images" or "audio" when a request body of any API here sends media (the first one
    found), else None: a glance at its shape, before anything is read or loaded."""
    if isinstance(body.get("images"), list) and body["images"]:        # Ollama's generate
        return "images"
    for key in ("messages", "input"):
        items = body.get(key)
        for item in items if isinstance(items, list) else ():
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("images"), list) and item["images"]:   # Ollama's chat
                return "images"
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _PARTS:
                    return _PARTS[kind]
    return None


def count(messages) -> None:
    """Refuse more than media.MAX_ITEMS media parts, before any is read."""
    n = sum(1 for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") in KINDS)
    try:
        count_ok(n, "the request")
    except MediaError as e:
        raise BadRequest(str(e), "messages") from None


class Reader:
    """A request's media, read part by part in the conversation's order."""

    def __init__(self, remote: bool = False) -> None:
        self.remote, self.media = remote, []

    def text(self, part: dict, where: str) -> str:
        """What a media part leaves in its message's text (the marker), its Media kept."""
        where = _where(part, where)
        try:
            medium = self._image(part.get(IMAGE), where) if part.get("type") == IMAGE \
                else self._audio(part.get(AUDIO), where)
        except MediaError as e:
            raise BadRequest(str(e), "messages") from None
        self.media.append(medium)
        return MARKER

    def _image(self, value, where: str) -> Media:
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise MediaError(f"{where}.image_url.url must be a data: URL or base64")
        if is_data_url(url):
            return from_data_url(url, where, "image")
        if is_remote(url):
            if not self.remote:
                raise MediaError(f"{where}: a remote image URL is fetched only when serve runs "
                                 "with --allow-remote-media; send the image as a data: URL")
            return fetch(url, where, "image")
        return from_base64(url, where, "image")

    def _audio(self, value, where: str) -> Media:
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise MediaError(f"{where}.input_audio needs data (base64) and format")
        said = value.get("format")
        if said not in _AUDIO_FORMATS:
            raise MediaError(f"{where}.input_audio.format must be one of "
                             f"{', '.join(_AUDIO_FORMATS)}")
        medium = from_base64(value["data"], where, "audio")
        if medium.format != said:
            raise MediaError(f"{where}: the audio is {medium.format.upper()}, not {said}")
        return medium


def joined(parts: list, where: str, reader: Reader | None) -> str:
    """A message's content parts as its text: text parts as they are, each medium as the
    marker (read by `reader`; without one, media parts are refused)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in KINDS and reader is not None:
            texts.append(reader.text(part, f"{where}[{j}]"))
        else:
            raise BadRequest(f"{where}[{j}]: only text, image_url and input_audio parts are "
                             "supported" + (f" (not {kind})" if isinstance(kind, str) else ""),
                             "messages")
    return "".join(texts)


class NoProjector(BadRequest):
    """Media sent to a model that has no projector for them; requests.prepare names the model."""

    def __init__(self, noun: str, model: str | None = None) -> None:
        self.noun = noun
        who = f"the model '{model[:200]}'" if model else "this model"
        super().__init__(f"{who} has no projector for {noun}: serve one that has "
                         "(docs/multimodal.md)", "messages", code="model_not_multimodal")

    def naming(self, model: str) -> NoProjector:
        return NoProjector(self.noun, model)


def capabilities(session) -> list[str]:
    """"vision" and "audio" as a loaded model's projector takes them (/api/show, /v1/models)."""
    projector = getattr(session, "media", None)
    if projector is None:
        return []
    return [name for name, on in (("vision", getattr(projector, "vision", False)),
                                  ("audio", getattr(projector, "audio", False))) if on]


def served(media: list[Media], session) -> None:
    """NoProjector when the session's model has no projector for these media."""
    projector = getattr(session, "media", None)
    for kind, noun in (("image", "images"), ("audio", "audio")):
        wanted = "vision" if kind == "image" else "audio"
        if any(m.kind == kind for m in media) and \
                not (projector is not None and getattr(projector, wanted, False)):
            raise NoProjector(noun)


def chat_tokens(session, messages: list[dict], extra: dict, media: list[Media]) -> list[int]:
    """A conversation with media as the model's tokens: its template rendered with the marker
    where each medium goes, the text between tokenized with special tokens on and each medium
    decoded into its placeholders by the model's projector (backends/llama/mtmd.py), as
    llama-mtmd-cli and llama-server tokenize a chat with media."""
    served(media, session)
    said = sum(m["content"].count(MARKER) for m in messages if isinstance(m.get("content"), str))
    if said != len(media):
        raise BadRequest(f"the messages' text spells {MARKER}, the marker that places media; "
                         "remove it", "messages")
    from localinfer.engine import prompt, templates
    template = session.chat_template
    # The text is tokenized with special tokens on, beside the media: no string of the request
    # (a message, a tool, a template variable) may spell a control token.
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    texts += prompt._strings([[prompt._beside_content(m) for m in messages], extra])
    if any(prompt._controls(session, session.tokenize(text.replace(MARKER, ""), special=True))
           for text in texts):
        raise BadRequest("a conversation with images or audio cannot spell the model's "
                         "control tokens in its text; remove them", "messages")
    marks = {"bos_token": prompt._text(session, session.bos_token),
             "eos_token": prompt._text(session, session.eos_token), "extra": extra}
    rendered = templates.render(template, prompt.placed_systems(template, messages, marks),
                                **marks).split(MARKER)
    if len(rendered) != len(media) + 1:     # the template dropped or repeated a message
        raise BadRequest("the model's chat template did not keep every medium's place",
                         "messages")
    parts: list = []
    for k, piece in enumerate(rendered):
        if k:
            parts.append(media[k - 1])
        if piece:
            parts.append((piece, True))
    return prompt.with_bos(session, session.media.tokenize(parts))


def _where(part: dict, where: str) -> str:
    said = part.get(WHERE)
    return said if isinstance(said, str) and len(said) < 200 else where
