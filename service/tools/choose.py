"""tool_choice `required` among several tools: the model's own choice, restricted to the tools offered.

The prompt ends with the forced opening up to the function's name (`{"name": "`). After its prefill, each offered
name (with its closing quote) is scored on the request's own cache, the most likely one is appended with the rest
of that tool's opening (service/tools/formats.py), and decoding continues from there: the reply is a call of an
offered tool whatever a small model would have named. One extra forward of a few tokens per tool, inside the
request's prefill step; nothing else changes in how it is served.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from service.tools.formats import CallFormat
from service.tools.spec import ToolChoice, ToolsParams


@dataclass
class Candidate:
    name: str
    name_ids: list[int]  # the name and its closing quote: what is scored
    rest_ids: list[int]  # the rest of the opening once the name is chosen
    text: str  # name + rest, as text (for the parser)


def candidates(fmt: CallFormat, params: ToolsParams, encode) -> list[Candidate]:
    head = fmt.forced_opening(params)
    out = []
    for tool in params.tools:
        full = fmt.forced_opening(replace(params, choice=ToolChoice("named", tool.name)))
        rest = full[len(head) + len(tool.name) + 1:]  # after `name"`
        out.append(Candidate(tool.name, encode(tool.name + '"'), encode(rest), full[len(head):]))
    return out


def choose_steps(rt, steps, options: list[Candidate], on_choice):
    """`steps` (a prefill returning a PrefillResult whose prompt ends just before a name), then the scoring: returns
    the PrefillResult of the prompt with the chosen candidate's ids appended; on_choice(candidate) is called first."""
    from service.kv.cache import truncate  # on the engine: the API imports this module without torch

    pre = yield from steps
    n = pre.n_prompt
    scores = []
    for c in options:
        scores.append(rt.continuation_logprob(pre.logits, c.name_ids, n, pre.cache))
        truncate(pre.cache, n)
        yield len(c.name_ids) - 1
    best = options[max(range(len(options)), key=scores.__getitem__)]
    on_choice(best)
    tail = best.name_ids + best.rest_ids
    logits = rt.forward(tail, n, pre.cache)
    yield len(tail)
    return replace(pre, logits=logits, n_prompt=n + len(tail), n_recomputed=pre.n_recomputed + len(tail))


def max_tail(options: list[Candidate]) -> int:
    return max(len(c.name_ids) + len(c.rest_ids) for c in options)
