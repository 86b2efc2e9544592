"""Engines: who runs a prepared request. `compose/` and `sessions/` hand one a Prepared and get events back.

Both implement the same small interface:
    async start(prep, finish) -> AsyncIterator[Delta | Final]   first event awaited: errors before it raise
    async health() -> bool                                       the engine answers (readiness)
    async close()
    keeps_conversations: bool                                    True: sessions send each turn whole, the engine's
                                                                 prefix cache keeps the conversation (vLLM)
    compiles_blocks: bool                                        True: the engine compiles and keeps blocks itself; the
                                                                 pipeline hands it BlockRefs (ids, no K/V)
    composes_sections: bool                                      True: a system prompt's sections are composed as
                                                                 blocks (service/compose/autoblocks.py)
embedded  service/engines/embedded.py: this process's serving engine (make run)
vllm      service/engines/vllm.py: a vLLM server, fed composed heads through service/vllm/connector.py
"""
