"""``llmhal.utils.current.Current``: the per-thread "current config / forward context" slot."""

from __future__ import annotations

import threading

import pytest

from llmhal.config import get_current_config
from llmhal.forward_context import get_forward_context
from llmhal.utils.current import Current


def test_nested_blocks_restore_the_outer_value_and_threads_do_not_share():
    slot: Current[str] = Current("nothing is current here")
    with pytest.raises(RuntimeError, match="^nothing is current here$"):
        slot.get()
    seen = []
    with slot.using("outer") as value:
        assert value == "outer"
        with slot.using("inner"):
            assert slot.get() == "inner"
            t = threading.Thread(target=lambda: seen.append(getattr(slot._local, "value", None)))
            t.start()
            t.join()
        assert slot.get() == "outer"
    assert seen == [None]
    with pytest.raises(RuntimeError):
        slot.get()


def test_missing_config_and_context_say_where_they_come_from():
    with pytest.raises(RuntimeError, match="set_current_config"):
        get_current_config()
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
