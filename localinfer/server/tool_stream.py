"""A streamed reply's tool calls as they are decoded (OpenAI's chat stream, Anthropic's Messages,
the Responses API): each call begins once its name is written (its id ours, from tools.new_id),
then its arguments come in pieces as the model writes them (engine/toolcalls/partial.py echoes
them as json.dumps writes them whole), so the pieces a client joins are the arguments of the
whole reply. The content around the calls is tools.Stream's. A format whose calls cannot be read
in order (a call_head that finds none, arguments written as a string) has its calls sent whole
at the end, as before.

Deltas are in OpenAI's streamed shape: {"index", "id", "type", "function": {"name",
"arguments": ""}} to begin a call, {"index", "function": {"arguments": piece}} after; each API
says them in its own events. Should the model be cut off inside a call (the context full), the
call ends where it got to and `Ending.cut` says so; what was sent cannot be taken back."""

from __future__ import annotations

from dataclasses import dataclass, field

from localinfer.engine.toolcalls.partial import JsonEcho
from localinfer.server import tools


@dataclass
class _Begun:
    index: int
    id: str
    name: str
    start: int                  # where its arguments begin in the text read
    echo: JsonEcho = field(default_factory=JsonEcho)
    sent: str = ""              # its arguments as sent so far


@dataclass
class Ending:
    rest: str                   # content not sent yet
    deltas: list[dict]          # to send now: the rest of calls begun, calls sent whole
    calls: list[dict]           # every call of the reply, arguments as a client has joined them
    cut: bool = False           # calls begun that the output ended inside


class CallStream(tools.Stream):
    """tools.Stream, with each call's arguments sent as they come (`pending`); `most`: the
    calls a reply may have (the Responses API's max_tool_calls), the rest never begun."""

    def __init__(self, plan_: tools.Plan | None, most: int | None = None) -> None:
        super().__init__(plan_)
        self.most = most
        self.begun: list[_Begun] = []
        self.stopped = False        # a call that could not be read in order: the rest whole

    def pending(self) -> list[dict]:
        """The call deltas the output so far allows."""
        if self.plan is None or self.stopped:
            return []
        fmt = self.plan.format
        text = self.raw if fmt.covers_trace else self.text
        out: list[dict] = []
        while True:
            if self.begun and not self.begun[-1].echo.done:
                last = self.begun[-1]
                piece = last.echo.feed(text[last.start + last.echo.used:])
                if last.echo.broken:
                    self.stopped = True
                if piece:
                    last.sent += piece
                    out.append({"index": last.index, "function": {"arguments": piece}})
                if not last.echo.done:
                    return out
            if self.most is not None and len(self.begun) >= self.most:
                return out
            at = self.begun[-1].start + self.begun[-1].echo.used if self.begun else 0
            found = fmt.call_head(text, at)
            if found is None:
                return out
            if found[0] not in self.plan.params:
                self.stopped = True
                return out
            call = _Begun(len(self.begun), tools.new_id(), found[0], found[1])
            self.begun.append(call)
            out.append({"index": call.index, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}})

    def ending(self) -> Ending:
        """What is left to send once the output is whole, and the reply's calls."""
        deltas = self.pending()
        rest, calls = self.finish()
        calls = calls[:self.most]
        if self.begun and not calls:    # cut inside a call: it ends as it got
            return Ending("", deltas, [_call(b, b.sent) for b in self.begun], cut=True)
        out = []
        for k, call in enumerate(calls):
            if k >= len(self.begun):            # never begun: sent whole
                whole = {**call, "index": k}
                deltas.append(whole)
                out.append(whole)
                continue
            begun, arguments = self.begun[k], call["function"]["arguments"]
            if arguments.startswith(begun.sent):
                if arguments != begun.sent:
                    deltas.append({"index": k, "function": {
                        "arguments": arguments[len(begun.sent):]}})
            else:       # a key written twice: what was sent, which means the same to a client
                arguments = begun.sent
            out.append(_call(begun, arguments))
        out += [_call(b, b.sent) for b in self.begun[len(calls):]]
        # the content before a call begun was sent before it; what a format's parse keeps
        # after one is nothing
        return Ending("" if self.begun else rest, deltas, out)


def _call(begun: _Begun, arguments: str) -> dict:
    return {"index": begun.index, "id": begun.id, "type": "function",
            "function": {"name": begun.name, "arguments": arguments}}
