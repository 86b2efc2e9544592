"""The user memory, the 12 user turns and the edits of bench/memory.py (deterministic, no data download).

The memory follows the paper's (section 9.1): `# USER MEMORY`, then `- [category] setting: enabled|disabled (note)`
lines from a catalog of 32 settings, tiled (`_2`, `_3`... suffixes) until it reaches the requested tokens. Each user
turn asks a gated question over two settings ("Proceed ONLY IF ALL of these settings are enabled"), so the memory
decides the answer; every few turns, before the turn, the first setting it asks about flips, by erratum, recompile
or in-place edit in turn.
"""

from __future__ import annotations

CATALOG = [
    ("privacy", "share_location"), ("notifications", "email_digest"), ("billing", "auto_renew"),
    ("shipping", "express_delivery"), ("accessibility", "large_text"), ("language", "translate_replies"),
    ("security", "two_factor"), ("marketing", "partner_offers"), ("notifications", "sms_alerts"),
    ("billing", "save_cards"), ("shipping", "gift_wrap"), ("accessibility", "screen_reader"),
    ("language", "formal_tone"), ("security", "login_alerts"), ("marketing", "newsletter"),
    ("privacy", "data_export"), ("privacy", "ad_tracking"), ("notifications", "push_alerts"),
    ("billing", "paperless_invoices"), ("shipping", "weekend_delivery"), ("accessibility", "high_contrast"),
    ("language", "metric_units"), ("security", "device_lock"), ("marketing", "birthday_coupons"),
    ("privacy", "voice_recordings"), ("notifications", "order_updates"), ("billing", "split_payments"),
    ("shipping", "eco_packaging"), ("accessibility", "captions"), ("language", "short_answers"),
    ("security", "trusted_devices"), ("marketing", "surveys"),
]
NOTES = ["set by the user in May", "confirmed on the phone", "default, never changed", "changed after a complaint",
         "set during sign-up", "asked twice to keep it"]
ASKS = ["Should I go ahead", "May I do it now", "Can I proceed for this customer", "Is it fine to continue",
        "Do I have the go-ahead", "Should this be done today"]
EDIT_MODES = ["erratum", "recompile", "in_place"]


def _state(i: int) -> str:
    return "disabled" if i % 3 == 0 else "enabled"


def settings(n_lines: int) -> list[tuple[str, str, str]]:
    """(category, label, value) of the first n_lines settings."""
    out = []
    for i in range(n_lines):
        cat, attr = CATALOG[i % len(CATALOG)]
        label = attr if i < len(CATALOG) else f"{attr}_{i // len(CATALOG) + 1}"
        out.append((cat, label, f"{_state(i)} ({NOTES[i % len(NOTES)]})"))
    return out


def memory_text(count_tokens, target_tokens: int) -> tuple[str, list[tuple[str, str, str]]]:
    """The memory text of about `target_tokens` tokens, and its settings."""
    n = 8
    while True:
        facts = settings(n)
        text = "# USER MEMORY\n" + "\n".join(f"- [{c}] {label}: {value}" for c, label, value in facts)
        if count_tokens(text) >= target_tokens:
            return text, facts
        n += 4


def schedule(facts: list[tuple[str, str, str]], turns: int, edit_every: int) -> list[dict]:
    """Per turn: the user text, and the edit made before it (None, or label, value, mode)."""
    out, n_edits, current = [], 0, {label: value for _, label, value in facts}
    for t in range(turns):
        a, b = facts[(7 * t + 3) % len(facts)], facts[(11 * t + 5) % len(facts)]
        user = (f"{ASKS[t % len(ASKS)]}? Proceed ONLY IF ALL of these settings are enabled: {a[1]}, {b[1]}. "
                "Answer yes or no.")
        edit = None
        if edit_every and t and t % edit_every == 0:
            old = current[a[1]].split()[0]
            current[a[1]] = current[a[1]].replace(old, "disabled" if old == "enabled" else "enabled", 1)
            edit = {"label": a[1], "value": current[a[1]], "mode": EDIT_MODES[n_edits % len(EDIT_MODES)]}
            n_edits += 1
        out.append({"user": user, "edit": edit})
    return out
