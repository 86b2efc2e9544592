"""Memory documents: facts, values, and the split into blocks that keeps lines that refer to each other together."""

import pytest

from service.errors import InvalidMemory
from service.memory.document import parse_facts, set_value, split_blocks, value_span


def words(text: str) -> int:
    return len(text.split())


MEM = """# USER MEMORY
- [privacy] share_location: disabled (set in May)
- [billing] auto_renew: enabled
- newsletter:enabled
* favourite colour: green
Plain text: not a list item, so no fact.
- [  ] also not a fact"""


def test_facts_labels_categories_values():
    facts = parse_facts(MEM)
    assert [(f.label, f.category, f.value, f.line) for f in facts] == [
        ("share_location", "privacy", "disabled (set in May)", 1), ("auto_renew", "billing", "enabled", 2),
        ("newsletter", None, "enabled", 3), ("favourite colour", None, "green", 4)]
    with pytest.raises(InvalidMemory, match="given twice"):
        parse_facts("- a: 1\n- b: 2\n- a: 3")


def test_set_value_replaces_only_the_value_and_says_where_it_is():
    text, (s, e) = set_value(MEM, "auto_renew", "disabled (user asked)")
    assert text == MEM.replace("auto_renew: enabled", "auto_renew: disabled (user asked)")
    assert text[s:e] == "disabled (user asked)" and value_span(text, "auto_renew") == (s, e)
    text, (s, e) = set_value(MEM, "newsletter", "off")  # `label:value` gets its space
    assert "- newsletter: off\n" in text and text[s:e] == "off"
    with pytest.raises(InvalidMemory, match="no fact labelled"):
        set_value(MEM, "nope", "x")
    with pytest.raises(InvalidMemory, match="one line"):
        set_value(MEM, "auto_renew", "two\nlines")


def test_no_limit_is_one_block_and_blocks_rejoin_to_the_text():
    assert split_blocks(MEM, words, None) == [MEM]
    blocks = split_blocks(MEM, words, 8)
    assert len(blocks) > 1 and "\n".join(blocks) == MEM
    assert all(b.strip() for b in blocks)


def test_a_heading_stays_with_the_line_after_it():
    text = "# A\n- a: 1\n# B\n- b: 2\n# C\n- c: 3"
    blocks = split_blocks(text, words, 1)
    assert blocks == ["# A\n- a: 1", "# B\n- b: 2", "# C\n- c: 3"]


def test_lines_that_refer_to_each_other_are_never_cut_apart():
    lines = [f"- fact_{i}: value {i} of the profile" for i in range(8)]
    lines[6] = "- shipping_address: same as billing_address unless fact_3 says otherwise"
    lines[1] = "- billing_address: 12 Rue de la Paix"
    text = "\n".join(lines)
    blocks = split_blocks(text, words, 10)  # ~7 words a line: one line a block where no reference forbids it
    assert "\n".join(blocks) == text
    holder = [i for i, b in enumerate(blocks) if "shipping_address" in b]
    assert len(holder) == 1
    together = blocks[holder[0]]
    assert "billing_address: 12" in together and "fact_3:" in together  # lines 1..6 in one block
    assert len(blocks) == 3  # line 0, lines 1-6, line 7
    # the same text without the references splits line by line: the test above can fail
    plain = "\n".join(f"- fact_{i}: value {i} of the profile" for i in range(8))
    assert len(split_blocks(plain, words, 10)) == 8


def test_blank_lines_never_make_a_block_of_their_own():
    text = "\n\n- a: 1 2 3 4\n\n- b: 1 2 3 4\n- c: 1 2 3 4"
    blocks = split_blocks(text, words, 3)
    assert "\n".join(blocks) == text and all(b.strip() for b in blocks)
