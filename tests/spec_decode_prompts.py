"""The constrained copy prompt the speculative-decoding tests share (offline and served): a
JSON object the user asks to have repeated, so prompt lookup drafts long runs of it, with a
schema and a regex its answer can be held to."""

from __future__ import annotations

import json

PERSON = {"name": "Ada Lovelace", "born": 1815, "city": "London", "languages": ["English"]}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "city": {"type": "string", "maxLength": 12},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "maxItems": 3,
        },
    },
    "required": ["name", "born", "city", "languages"],
    "additionalProperties": False,
}
ASK_JSON = [{"role": "user", "content": "Repeat this JSON object exactly:\n" + json.dumps(PERSON)}]
REGEX = r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}"
