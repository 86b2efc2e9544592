"""Engines: who runs a prepared request. `compose/` and `sessions/` hand one a Prepared and get events back.

embedded  service/engines/embedded.py: this process's serving engine (make run)
vllm      service/engines/vllm.py: a vLLM server computes every token; its KV connector (service/vllm/connector.py)
          saves compiled blocks and loads composed heads, re-rotated

Both implement Engine (service/compose/engine.py), the one interface the pipeline, sessions and the app state use:
it is defined where it is used, so nothing below this package imports it.
"""

