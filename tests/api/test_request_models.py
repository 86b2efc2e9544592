"""One request model per API, one composition part: the same bounds hold on /v1/compose, chat completions and
sessions (they had drifted: chat's `fields` had no bound), and the same body maps to the same parameters."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.api.params import seam_tokens, skill_refs
from service.api.schemas.chat import ChatRequest
from service.api.schemas.common import Composition
from service.api.schemas.compose import ComposeToolsRequest
from service.api.schemas.sessions import SessionCreate
from service.compose.pipeline import SkillRef

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BODIES = {ComposeToolsRequest: {"user": "hi"}, ChatRequest: CHAT, SessionCreate: {"system": "s"}}


@pytest.mark.parametrize("model", list(BODIES))
def test_every_api_takes_the_composition_part(model):
    assert issubclass(model, Composition)
    body = model.model_validate({**BODIES[model], "skills": ["a", {"name": "b", "version": 2}],
                                 "fields": {"tier": "gold"}, "seam_tokens": "auto", "memory": "notes"})
    assert skill_refs(body) == [SkillRef("a"), SkillRef("b", 2)] and seam_tokens(body) is None
    assert body.memory == "notes" and body.fields == {"tier": "gold"}


@pytest.mark.parametrize("model", list(BODIES))
@pytest.mark.parametrize("bad", [{"fields": {f"f{i}": "v" for i in range(257)}}, {"fields": {"f": "v" * 1025}},
                                 {"seam_tokens": 5000}, {"skills": ["Not A Name!"]}, {"mode": "fast"},
                                 {"memory_seam_tokens": -1}])
def test_the_same_bounds_on_every_api(model, bad):
    with pytest.raises(ValidationError):
        model.model_validate({**BODIES[model], **bad})
