"""The console's forms, read into the same strict model the admin API and the CLI use (admin_models.KeyCreate),
with one message per field a person can act on. Empty means "not given": a limit left empty is the config's
key_defaults, as everywhere else."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from zoneinfo import ZoneInfo

from pydantic import ValidationError

from pagedserve.gateway.admin_models import KeyCreate

WHOLE = re.compile(r"\d{1,13}")
DECIMAL = re.compile(r"\d{1,9}(\.\d{1,9})?")
RULES = {
    "user": "1-128 letters, digits or . @ + _ -",
    "team": "empty, or 1-128 letters, digits or . @ + _ -",
    "models": "route names separated by commas, each 1-128 letters, digits or . @ + _ -",
    "residency": "empty, or 1-64 letters, digits, _ or -",
    "rpm": "empty (the default), or a whole number of requests per minute from 1",
    "tpm": "empty (the default), or a whole number of tokens per minute from 1",
    "daily_budget_usd": "empty (the default), or dollars from 0 (0 allows no spend)",
}
LABELS = {"daily_budget_usd": "daily budget", "rpm": "requests per minute", "tpm": "tokens per minute"}
KEY_FIELDS = ("user", "team", "models", "residency", "rpm", "tpm", "daily_budget_usd")


@dataclass(slots=True)
class KeyForm:
    values: dict[str, str]  # as typed, to fill the form again
    errors: list[str] = field(default_factory=list)
    key: KeyCreate | None = None


def read_key_form(form: dict[str, str], user: str | None = None) -> KeyForm:
    """A key's fields from a form; `user` fixed when an existing key is edited (its owner does not change)."""
    values = {name: form.get(name, "").strip() for name in KEY_FIELDS}
    if user is not None:
        values["user"] = user
    out = KeyForm(values)
    fields: dict = {"user": values["user"], "models": [m.strip() for m in values["models"].split(",") if m.strip()]}
    for name in ("team", "residency"):
        if values[name]:
            fields[name] = values[name]
    for name, pattern, kind in (("rpm", WHOLE, int), ("tpm", WHOLE, int), ("daily_budget_usd", DECIMAL, float)):
        if not values[name]:
            continue
        if not pattern.fullmatch(values[name]):
            out.errors.append(problem(name, values[name]))
        else:
            fields[name] = kind(values[name])
    try:
        key = KeyCreate.model_validate(fields)
    except ValidationError as e:
        for err in e.errors():
            name = str(err["loc"][0]) if err["loc"] else "form"
            text = problem(name, values.get(name, ""))
            if text not in out.errors:
                out.errors.append(text)
    else:
        out.key = None if out.errors else key
    return out


def problem(name: str, value: str) -> str:
    """What is wrong with a field, naming the value typed (the template prints it as text)."""
    return f"{LABELS.get(name, name)} “{value[:200]}”: must be {RULES.get(name, 'valid')}"


def parse_time(value: str, tz: ZoneInfo) -> float | None:
    """A datetime-local field (YYYY-MM-DDTHH:MM, the gateway's time zone) as epoch seconds; None if empty or bad."""
    try:
        return datetime.fromisoformat(value).replace(tzinfo=tz).timestamp() if value else None
    except ValueError:
        return None


def parse_number(value: str) -> float | None:
    return float(value) if value and DECIMAL.fullmatch(value) else None
