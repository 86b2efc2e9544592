"""User memories: Markdown facts, precompiled into blocks, floated before every user turn (the paper's section 9)."""
