"""Config fuzzing: every key of bladed.toml, given values of the wrong type or
out of range, gives a ConfigError whose message names the key."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from bladed.config import Config, ConfigError, config_from_dict


def keys() -> list[tuple[str, str, object]]:
    out = []
    for sec in dataclasses.fields(Config):
        if sec.name == "source":
            continue
        default = sec.default_factory() if sec.default_factory is not dataclasses.MISSING else sec.default  # type: ignore[misc]
        for f in dataclasses.fields(default):
            out.append((sec.name, f.name, getattr(default, f.name)))
    return out


KEYS = keys()
BAD = st.one_of(st.just([1, 2]), st.just({"x": 1}), st.just("not-a-value\u2603"), st.just(-1), st.just(1.5),
                st.just(True), st.just(2**70), st.just(""), st.text(max_size=5))


@settings(max_examples=600, deadline=None)
@given(key=st.sampled_from(KEYS), bad=BAD)
def test_every_invalid_value_names_its_key(key: tuple[str, str, object], bad: object) -> None:
    section, name, default = key
    try:
        cfg = config_from_dict({section: {name: bad}})
    except ConfigError as e:
        assert f"{section}.{name}" in str(e), (key, bad, str(e))
        return
    # accepted: then it must be a sensible value of the key's type (e.g. "" for an optional path)
    value = getattr(getattr(cfg, section), name)
    assert value is None or default is None or isinstance(value, type(default)) or \
        (isinstance(default, int) and isinstance(value, int)), (key, bad, value)


def test_unknown_keys_and_sections_are_named() -> None:
    for data, needle in [({"device": {"sise": "1G"}}, "device.sise"), ({"devise": {}}, "devise")]:
        try:
            config_from_dict(data)
        except ConfigError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"{data} accepted")
