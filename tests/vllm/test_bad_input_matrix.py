"""The vLLM plugin's rows of the bad-input matrix (issue 14; the core's rows are tests/test_bad_input_matrix.py,
which also covers the plugin's checks that need no vLLM).

Malformed SpecPrefill arguments in a request's ``extra_args`` (``vllm_xargs`` over HTTP) are refused at
admission: the plugin raises ``ValueError`` naming the argument and the fix, which vLLM turns into its
``VLLMValidationError`` (HTTP 400 on the server; an exception from ``LLM.generate``). Each row is checked
on the plugin's function and through a real in-process engine, which then serves a good compressed
request. The docs page "Bad input" is generated from these rows.
"""

import re

import pytest

from specprefill_rag.vllm_plugin.validation import check_arguments

LENGTH, RUNS = "specprefill_prompt_length", "specprefill_runs"
PROMPT = [5, 6, 7]  # three kept tokens
GOOD = {LENGTH: 10, RUNS: [0, 1, 4, 1, 9, 1]}  # at positions 0, 4 and 9 of a 10-token prompt

ROWS = [
    # (case, extra_args, message); the last two are refused by the admission hook, which sees the prompt
    ("prompt length without runs", {LENGTH: 10}, f"need both {LENGTH} and {RUNS}"),
    ("runs without prompt length", {RUNS: [0, 3]}, f"need both {LENGTH} and {RUNS}"),
    ("prompt length: 0", {LENGTH: 0, RUNS: [0, 3]}, f"{LENGTH} must be a positive integer, got 0"),
    ("prompt length: str", {LENGTH: "10", RUNS: [0, 3]}, f"{LENGTH} must be a positive integer, got '10'"),
    ("prompt length: float", {LENGTH: 10.0, RUNS: [0, 3]}, f"{LENGTH} must be a positive integer, got 10.0"),
    ("prompt length: bool", {LENGTH: True, RUNS: [0, 1]}, f"{LENGTH} must be a positive integer, got True"),
    ("runs: None", {LENGTH: 10, RUNS: None}, f"{RUNS} must be a flat list of integer \\(start, length\\) pairs; send"),
    ("runs: str", {LENGTH: 10, RUNS: "0,3"}, f"{RUNS} must be a flat list"),
    (
        "runs: odd length",
        {LENGTH: 10, RUNS: [0, 1, 9]},
        f"{RUNS} must be a flat list of integer \\(start, length\\) pairs",
    ),
    ("runs: float", {LENGTH: 10, RUNS: [0, 1.0, 9, 2]}, "integer \\(start, length\\) pairs"),
    ("runs: negative start", {LENGTH: 10, RUNS: [-1, 2, 9, 1]}, "starts must be >= 0 and lengths > 0; send"),
    ("runs: zero length", {LENGTH: 10, RUNS: [0, 0, 9, 1]}, "starts must be >= 0 and lengths > 0"),
    ("runs: overlapping", {LENGTH: 10, RUNS: [0, 5, 4, 1, 9, 1]}, "strictly increasing; send runs in order"),
    ("runs: huge", {LENGTH: 2**63, RUNS: [0, 2**62]}, "below 2\\*\\*62"),
    ("runs: not ending at L - 1", {LENGTH: 10, RUNS: [0, 1, 4, 1, 8, 1]}, "must end at the last prompt position 9"),
    ("runs: past the prompt", {LENGTH: 10, RUNS: [0, 1, 4, 1, 9, 3]}, "must end at the last prompt position 9"),
]
ADMISSION_ROWS = [  # (case, extra_args, max_tokens, message); no row expands its runs (2**40 would need 8 TB)
    (
        "2**40 positions for 3 tokens",
        {LENGTH: 2**40, RUNS: [0, 2**40]},
        2,
        "L=1099511627776 \\+ max_tokens=2 = 1099511627778 exceeds max_model_len=1024",
    ),
    (
        "4 positions for 3 tokens",
        {LENGTH: 10, RUNS: [0, 2, 4, 1, 9, 1]},
        2,
        f"{RUNS} cover 4 positions but the prompt has 3 tokens; send exactly the kept token ids",
    ),
    ("L + max_tokens over max_model_len", GOOD, 1020, "L=10 \\+ max_tokens=1020 = 1030 exceeds max_model_len=1024"),
]


@pytest.mark.parametrize("case, args, message", ROWS, ids=[row[0] for row in ROWS])
def test_plugin_refuses_malformed_arguments(case, args, message):
    with pytest.raises(ValueError, match=message):
        check_arguments(args)


@pytest.mark.parametrize(
    "case, args, max_tokens, message",
    [(case, args, 2, message) for case, args, message in ROWS] + ADMISSION_ROWS,
    ids=[row[0] for row in ROWS + ADMISSION_ROWS],
)
def test_engine_refuses_the_request_and_keeps_serving(case, args, max_tokens, message, llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    request = [{"prompt_token_ids": PROMPT}]
    with pytest.raises(VLLMValidationError) as refused:
        llm.generate(request, SamplingParams(max_tokens=max_tokens, extra_args=args), use_tqdm=False)
    assert re.search(message, str(refused.value)), str(refused.value)
    good = SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False, extra_args=GOOD)
    assert len(llm.generate(request, good, use_tqdm=False)[0].outputs[0].token_ids) == 2
