"""Request state: token counts and the stop decision after each appended token."""

from __future__ import annotations

import pytest

from shoal.engine.request import Request, RequestStatus
from shoal.engine.sampling import SamplingParams

EOS = frozenset({2})


def make(prompt=(5, 6, 7), **params) -> Request:
    return Request(request_id="r", prompt_token_ids=list(prompt), params=SamplingParams(**params))


def test_counts_and_slices_span_prompt_and_output():
    request = make()
    assert request.status is RequestStatus.WAITING
    request.append_output(8)
    request.append_output(9)
    assert request.num_tokens == 5 and request.num_output_tokens == 2
    assert request.token_ids_slice(0, 5) == [5, 6, 7, 8, 9]
    assert request.token_ids_slice(1, 2) == [6]
    assert request.token_ids_slice(3, 5) == [8, 9]
    assert request.token_ids_slice(2, 4) == [7, 8]


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        make(prompt=())


def test_eos_stops_unless_ignored():
    request = make()
    request.append_output(2)
    assert request.check_stop(EOS, 100) == "stop"
    ignoring = make(ignore_eos=True)
    ignoring.append_output(2)
    assert ignoring.check_stop(EOS, 100) is None


def test_stop_token_ids_stop_even_with_ignore_eos():
    request = make(stop_token_ids=(11,), ignore_eos=True)
    request.append_output(10)
    assert request.check_stop(EOS, 100) is None
    request.append_output(11)
    assert request.check_stop(EOS, 100) == "stop"


def test_min_tokens_defers_eos_and_stop_ids():
    request = make(min_tokens=2, stop_token_ids=(11,))
    request.append_output(2)
    assert request.check_stop(EOS, 100) is None
    request.append_output(11)
    assert request.check_stop(EOS, 100) == "stop"


def test_max_tokens_and_max_model_len_give_length():
    request = make(max_tokens=2)
    request.append_output(10)
    assert request.check_stop(EOS, 100) is None
    request.append_output(10)
    assert request.check_stop(EOS, 100) == "length"
    short_context = make()
    short_context.append_output(10)
    assert short_context.check_stop(EOS, 5) is None
    short_context.append_output(10)
    assert short_context.check_stop(EOS, 5) == "length"


def test_eos_on_the_last_allowed_token_reports_stop():
    request = make(max_tokens=1)
    request.append_output(2)
    assert request.check_stop(EOS, 100) == "stop"
