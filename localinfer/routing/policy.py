"""What a router is once its config table is checked: its models and its policy, and the two
decisions a policy makes — whether a cascade's answer stands (`Cascade.decide` on a confidence
measured from the model's own tokens), and which model a rule router sends a request to
(`Rules.choose` on what the request holds)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localinfer.engine.logprobs import TokenLogprob

# How the first tokens' log-probabilities make one confidence figure:
#   mean    the mean log-probability of the chosen tokens (at most 0; 0: certain)
#   min     the least of them: one doubtful token is enough to go up
#   margin  the mean margin in nats of each chosen token over the likeliest other token (0 or
#           more when the chosen token is the likeliest, as greedy decoding's always is)
MEASURES = ("mean", "min", "margin")
# The default decision: after 16 tokens on the mean log-probability. The threshold is the one
# `frontier --router` chose on SmolLM2 Q4_0 -> F16 (docs/routing.md, "Measured frontier").
DEFAULT_MEASURE = "mean"
DEFAULT_TOKENS = 16
DEFAULT_THRESHOLD = -0.7
# The decision waits for at most this many tokens: the time to first token of an answer that
# stands is the small model's prefill and these tokens' decode.
MAX_TOKENS = 256


@dataclass(frozen=True)
class Cascade:
    """The cheapest model answers; after its first `tokens` tokens (or at its end, if sooner) its
    confidence on `measure` decides: at or above `threshold` the answer stands, below it the
    request goes to the next model. -inf always keeps the answer, inf never does."""

    threshold: float = DEFAULT_THRESHOLD
    tokens: int = DEFAULT_TOKENS
    measure: str = DEFAULT_MEASURE

    @property
    def top(self) -> int:
        """The alternatives each token's score needs (Limits.logprobs): the runner-up's for the
        margin, none otherwise."""
        return 2 if self.measure == "margin" else 0

    def confidence(self, scored: Sequence[TokenLogprob]) -> float:
        """The confidence of the first `tokens` scored tokens; nan when there are none (an
        empty answer) or the engine gave no distribution."""
        return confidence(scored[:self.tokens], self.measure)

    def decide(self, confidence: float) -> bool:
        """Whether an answer of this confidence stands (nan: only under a threshold of -inf)."""
        if self.threshold == -math.inf:
            return True
        return not math.isnan(confidence) and confidence >= self.threshold


def confidence(scored: Sequence[TokenLogprob], measure: str) -> float:
    """One figure for `scored` (see MEASURES); nan for no tokens."""
    if not scored:
        return math.nan
    if measure == "margin":
        values = [_margin(s) for s in scored]
    else:
        values = [s.logprob for s in scored]
    if measure == "min":
        return min(values)
    return math.fsum(values) / len(values)


def _margin(scored: TokenLogprob) -> float:
    """The chosen token's log-probability less that of the likeliest other token (its top list
    holds the two likeliest tokens, best first)."""
    others = [lp for token, lp in scored.top if token != scored.token]
    return scored.logprob - others[0] if others else math.inf


@dataclass(frozen=True)
class Facts:
    """What a rule router looks at in a request. `prompt_tokens` is counted by the router's
    first model's vocabulary (None: not counted, as no rule asks for it)."""

    prompt_tokens: int | None = None
    schema: bool = False            # a JSON schema or a grammar constrains the answer
    tools: bool = False             # tools are offered (serve)
    thinking: bool = False          # a thinking trace is asked for (--think, think=True)
    priority: str | None = None     # an explicit priority the caller gave


@dataclass(frozen=True)
class Rule:
    """One rule: every condition it sets must hold (None: not looked at); then `model`."""

    model: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    schema: bool | None = None
    tools: bool | None = None
    thinking: bool | None = None
    priority: str | None = None

    def matches(self, facts: Facts) -> bool:
        n = facts.prompt_tokens
        if self.min_prompt_tokens is not None and (n is None or n < self.min_prompt_tokens):
            return False
        if self.max_prompt_tokens is not None and (n is None or n > self.max_prompt_tokens):
            return False
        flags = ((self.schema, facts.schema), (self.tools, facts.tools),
                 (self.thinking, facts.thinking))
        if any(want is not None and want != have for want, have in flags):
            return False
        return self.priority is None or self.priority == facts.priority

    @property
    def counts_tokens(self) -> bool:
        return self.min_prompt_tokens is not None or self.max_prompt_tokens is not None


@dataclass(frozen=True)
class Rules:
    """Rules tried in order; the first that matches names the model, none: `default`."""

    rules: tuple[Rule, ...]
    default: str

    def choose(self, facts: Facts) -> tuple[str, int | None]:
        """(the model or router, the index of the rule that chose it; None: the default)."""
        for i, rule in enumerate(self.rules):
            if rule.matches(facts):
                return rule.model, i
        return self.default, None

    @property
    def counts_tokens(self) -> bool:
        return any(rule.counts_tokens for rule in self.rules)


@dataclass(frozen=True)
class Router:
    """A `[routers.NAME]` table of config.toml, checked: `models` as written (cheapest first for
    a cascade; a rule router's may name other routers), and the policy."""

    name: str
    models: tuple[str, ...]
    policy: Cascade | Rules
    path: Path              # the config file it is declared in, for messages

    @property
    def kind(self) -> str:
        return "cascade" if isinstance(self.policy, Cascade) else "rule"

    def decide(self, confidence: float) -> bool:
        """A cascade's decision (see Cascade.decide)."""
        if not isinstance(self.policy, Cascade):
            raise TypeError(f"router {self.name} is a rule router; it decides by rules")
        return self.policy.decide(confidence)

    def describe(self) -> list[tuple[str, str]]:
        """(field, value) lines for `show` and `info`."""
        lines = [("router", self.name), ("declared in", f"{self.path} [routers.{self.name}]"),
                 ("policy", self.kind), ("models", ", ".join(self.models))]
        policy = self.policy
        if isinstance(policy, Cascade):
            lines += [("decides after", f"{policy.tokens} tokens"),
                      ("confidence", policy.measure),
                      ("threshold", f"{policy.threshold:g}")]
        else:
            lines += [(f"rule {i + 1}", _rule_text(rule)) for i, rule in enumerate(policy.rules)]
            lines.append(("otherwise", policy.default))
        return lines


def _rule_text(rule: Rule) -> str:
    from localinfer.user_config import toml_value
    conditions = [f"{key.replace('_', '-')} = {toml_value(value)}" for key, value in
                  (("min_prompt_tokens", rule.min_prompt_tokens),
                   ("max_prompt_tokens", rule.max_prompt_tokens), ("schema", rule.schema),
                   ("tools", rule.tools), ("thinking", rule.thinking),
                   ("priority", rule.priority)) if value is not None]
    return f"{' and '.join(conditions) or 'always'} -> {rule.model}"
