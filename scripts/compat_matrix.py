"""The feature x feature compatibility matrix and the generator of its page
(docs/features/compatibility.md).

Every pair of FEATURES has one cell in CELLS, and every cell carries its evidence:
`works(test ids)`: a test runs the two features together; `refused(error, test ids)`: the
pair is refused with that error and a test checks it; `not_run(reason)`: only for CUDA, which
no machine of this project has, so nothing about it is claimed as tested.

A test a `works` cell names shows that both features acted, through the `compat` fixture of
tests/compat_evidence.py (`compat.exercised("spec", num_drafts=...)`: each call checks an
observed proof); a test a `refused` cell names records the error it saw
(`compat.refused("tp", "lora", error)`).

Usage (standard library only):
  python scripts/compat_matrix.py                 write docs/features/compatibility.md
  python scripts/compat_matrix.py --check         exit 1 when a cell lacks evidence, a named
                                                  test function is missing or the page is out
                                                  of date (scripts/check_docs.py runs this)
  python scripts/compat_matrix.py --collect-only  --check, and every named test id must be
                                                  collected by pytest (`make check` runs this)
  python scripts/compat_matrix.py --collect       --check, then run every named test (pytest
                                                  --compat-evidence): exit 1 naming the cell
                                                  and test when a test failed or was skipped,
                                                  a `works` test did not show both features or
                                                  a `refused` test did not record the refusal
  ... --collect --cell spec,grpc [--cell ...]     only those cells' tests
  ... --collect --evidence F [--evidence F2]      check the evidence files that test runs
                                                  wrote (scripts/test with COMPAT_EVIDENCE=F,
                                                  as .ci/run does) instead of running again
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

PAGE = "docs/features/compatibility.md"

FEATURES = {
    "tp": "Tensor parallelism",
    "gguf": "GGUF blocks",
    "int8": "int8",
    "lora": "LoRA",
    "spec": "Speculative decoding",
    "structured": "Structured output",
    "grpc": "gRPC",
    "router": "Router",
    "reasoning": "Reasoning parser",
    "embed": "Embeddings",
    "messages": "Messages API",
    "priority": "Priority scheduling",
    "tokenio": "Token-level I/O",
    "recorder": "Flight recorder",
    "tracing": "OpenTelemetry tracing",
    "kvdtype": "Quantized KV cache",
    "sleep": "Sleep mode",
    "offload": "KV offload",
    "pd": "PD disaggregation",
    "llamacpp": "llama.cpp native API",
    "cuda": "CUDA",
}
NOT_RUN_ALLOWED = {"cuda"}  # the only feature no machine here can run


@dataclass(frozen=True)
class Cell:
    state: str  # "works" | "refused" | "not run"
    tests: tuple[str, ...] = ()
    error: str = ""
    note: str = ""


def works(*tests: str, note: str = "") -> Cell:
    return Cell("works", tests, note=note)


def refused(error: str, *tests: str, note: str = "") -> Cell:
    return Cell("refused", tests, error=error, note=note)


def not_run(note: str) -> Cell:
    return Cell("not run", note=note)


TP = "tests/test_compat_tensor_parallel.py::"
QUANT = "tests/test_compat_quantized.py::"
LORA = "tests/test_compat_lora.py::"
REFUSALS = "tests/test_compat_refusals.py::"
NO_GPU = "not run: no GPU here."
CPU_ONLY = "The engine refuses it (`--quantization {} runs on the CPU only`); " + NO_GPU
TP_REFUSED = TP + "test_unsupported_features_are_refused_before_ranks_start[{}]"
Q_SPEC = QUANT + "test_speculation_runs_on_the_quantized_weights[{}]"
Q_GRPC = QUANT + "test_structured_output_over_grpc_on_the_quantized_weights[{}]"
Q_ROUTER = QUANT + "test_router_in_front_of_the_quantized_worker_keeps_the_schema[{}]"
REASONING = "tests/test_compat_reasoning.py::"
R_SHARDED = REASONING + "test_sharded_worker_splits_the_thinking_through_the_router"
R_MESSAGES = REASONING + "test_messages_on_the_sharded_worker_through_the_router"
R_GRPC = REASONING + "test_grpc_chat_splits_the_thinking_and_returns_token_level_output"
R_INT8 = REASONING + "test_int8_weights_think_answer_and_score_the_prompt"
MESSAGES = "tests/test_compat_messages.py::"
M_ADAPTER = MESSAGES + "test_naming_the_adapter_runs_it_under_the_messages_api_and_the_parser"
EMBED = "tests/test_compat_embed.py::"
EMBEDDINGS = "tests/test_embeddings.py::"
TOKEN_IO = "tests/test_token_io_compat.py::"
T_SHARDED = TOKEN_IO + "test_tensor_parallel_worker_over_router_and_grpc"
UNRECOGNIZED = "Unrecognized request argument supplied: {}"
RECORDER = "tests/test_flight_recorder.py::"
RECORDER_COMPAT = "tests/test_flight_recorder_compat.py::"
REC_STACK = (
    RECORDER_COMPAT + "test_gguf_blocks_with_speculation_behind_the_router_record_and_replay"
)
REC_SPEC = RECORDER + "test_replay_reproduces_every_step_and_token"
COMPAT_RECORDER = "tests/test_compat_recorder.py::"
REC_INT8 = COMPAT_RECORDER + "test_a_traced_int8_reasoning_chat_with_token_io_is_recorded"
REC_REPLAY = COMPAT_RECORDER + "test_the_int8_reasoning_record_replays_identically"
TRACING = "tests/test_tracing.py::"
TRACE_SHARDED = (
    "tests/test_compat_tracing.py::"
    "test_a_sharded_reasoning_chat_with_priority_and_token_io_is_traced"
)
KV_DTYPE = "tests/test_kv_cache_dtype.py::"
KV_REFUSED = KV_DTYPE + "test_combinations_it_cannot_run_are_refused_before_loading[{}]"
SLEEP = "tests/test_sleep_compat.py::"
SLEEP_SERVER = "tests/test_sleep_mode.py::"
OFFLOAD = "tests/test_kv_offload.py::"
OFFLOAD_REFUSED = OFFLOAD + "test_what_it_cannot_extend_is_refused_at_start[{}]"
MEMORY = "tests/test_compat_memory.py::"
MEMORY_SERVER = "tests/test_compat_memory_server.py::"
KV_STACK = MEMORY + "test_an_int8_kv_cache_thinks_answers_with_token_io_traced_and_recorded"
KV_SLEEP = MEMORY + "test_a_level_2_sleep_refuses_both_routes_and_the_wake_gives_the_same_tokens"
KV_REPLAY = MEMORY + "test_the_int8_kv_record_with_its_sleep_replays_identically"
STORE_STACK = MEMORY + "test_a_restarted_int8_reasoning_server_reads_the_prefix_from_the_store"
STORE_REPLAY = MEMORY + "test_records_of_the_store_servers_replay_from_the_pool_or_the_named_store"
PD = "tests/test_compat_pd.py::"
PD_CLUSTER = "tests/test_cluster_pd.py::"
PD_GREEDY = PD_CLUSTER + "test_greedy_output_through_pd_equals_a_colocated_server"
PD_GGUF = PD + "test_gguf_blocks_answer_through_pd_as_the_decode_worker_alone"
PD_INT8 = PD + "test_int8_weights_and_the_reasoning_parser_through_pd"
PD_REFUSED = PD + "test_a_worker_role_refuses_what_the_store_cannot_carry[{}]"
LLAMACPP = "tests/test_llamacpp_completion.py::"
L_RECORDED = COMPAT_RECORDER + "test_an_anthropic_message_is_recorded"
L_DRAFTS = MESSAGES + "test_a_message_runs_with_accepted_drafts"

CELLS: dict[tuple[str, str], Cell] = {
    ("tp", "gguf"): refused(
        "tensor parallelism with --quantization is not supported yet",
        TP_REFUSED.format("quantization"),
        note="Without `--quantization`, a GGUF model is sharded as dequantized weights.",
    ),
    ("tp", "int8"): refused(
        "tensor parallelism with --quantization is not supported yet",
        "tests/test_tensor_parallel.py::test_quantization_with_tensor_parallelism_is_rejected",
    ),
    ("tp", "lora"): refused(
        "tensor parallelism with LoRA adapters is not supported yet", TP_REFUSED.format("lora")
    ),
    ("tp", "spec"): refused(
        "tensor parallelism with speculative decoding is not supported yet",
        TP_REFUSED.format("speculation"),
    ),
    ("tp", "structured"): works(
        TP + "test_sharded_worker_constrains_output_over_grpc",
        TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice",
    ),
    ("tp", "grpc"): works(TP + "test_sharded_worker_constrains_output_over_grpc"),
    ("tp", "router"): works(TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice"),
    ("tp", "cuda"): not_run(
        "The GPU count is checked before any rank starts "
        "(tests/test_tensor_parallel.py::test_more_ranks_than_gpus_is_a_clear_error); "
        "the NCCL run itself is " + NO_GPU
    ),
    ("gguf", "int8"): refused(
        "quantization must be int8 or fp16 or gguf or none (or unset)",
        "tests/test_quantization.py::test_cli_rejects_an_unknown_quantization_in_one_line",
        note="Alternatives, not a pair: `--quantization` takes one method.",
    ),
    ("gguf", "lora"): works(
        "tests/test_lora.py::test_adapter_on_the_gguf_blocks_matches_peft_merged_model",
        note="The adapter's delta is added in float32 beside each block matmul.",
    ),
    ("gguf", "spec"): works(
        Q_SPEC.format("gguf"),
        note="Verify steps run as one native call: copy 1.25x, greedy random text 1.73x "
        "the speed without speculation (docs/features/speculative-decoding.md).",
    ),
    ("gguf", "structured"): works(Q_GRPC.format("gguf"), Q_ROUTER.format("gguf")),
    ("gguf", "grpc"): works(Q_GRPC.format("gguf")),
    ("gguf", "router"): works(Q_ROUTER.format("gguf")),
    ("gguf", "cuda"): not_run(CPU_ONLY.format("gguf")),
    ("int8", "lora"): refused(
        "LoRA adapters with --quantization int8 are not supported",
        "tests/test_lora.py::test_lora_needs_enable_lora_and_no_quantization",
        REFUSALS + "test_lora_on_int8_weights_is_refused",
    ),
    ("int8", "spec"): works(Q_SPEC.format("int8")),
    ("int8", "structured"): works(Q_GRPC.format("int8"), Q_ROUTER.format("int8")),
    ("int8", "grpc"): works(Q_GRPC.format("int8")),
    ("int8", "router"): works(Q_ROUTER.format("int8")),
    ("int8", "cuda"): not_run(CPU_ONLY.format("int8")),
    ("lora", "spec"): works(LORA + "test_adapter_with_speculation_gives_the_peft_greedy_tokens"),
    ("lora", "structured"): works(LORA + "test_adapter_keeps_a_json_schema"),
    ("lora", "grpc"): works(
        LORA + "test_grpc_on_a_lora_worker_answers_with_the_base_model",
        note="gRPC's GenerateRequest has no `model` field: gRPC calls get the base model.",
    ),
    ("lora", "router"): works(LORA + "test_router_passes_the_adapter_name_through"),
    ("lora", "cuda"): not_run(NO_GPU),
    ("spec", "structured"): works(
        "tests/test_spec_decode_structured.py::test_greedy_constrained_batch_equals_no_speculation",
        "tests/test_spec_decode_server.py::test_structured_output_with_drafts_answers_as_without",
    ),
    ("spec", "grpc"): works(Q_GRPC.format("int8"), Q_GRPC.format("gguf")),
    ("spec", "router"): works(Q_ROUTER.format("int8"), Q_ROUTER.format("gguf")),
    ("spec", "cuda"): not_run(NO_GPU),
    ("structured", "grpc"): works(
        "tests/test_grpc.py::test_structured_outputs_constrain_generate_and_stream"
    ),
    ("structured", "router"): works(
        Q_ROUTER.format("int8"), TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice"
    ),
    ("structured", "cuda"): not_run(NO_GPU),
    ("grpc", "router"): refused(
        "unrecognized arguments: --grpc-port",
        REFUSALS + "test_the_router_has_no_grpc_port",
        note="The router proxies HTTP only; gRPC clients call a worker's `--grpc-port` "
        "(`cluster --grpc-port P`: worker i on P + i, "
        "`tests/test_cluster.py::test_each_worker_serves_grpc_on_its_own_port`).",
    ),
    ("grpc", "cuda"): not_run(NO_GPU),
    ("router", "cuda"): not_run(
        "The router itself never touches a device; workers on CUDA: " + NO_GPU
    ),
    # -- reasoning parser (--reasoning-parser) ----------------------------------------------
    ("tp", "reasoning"): works(R_SHARDED),
    ("gguf", "reasoning"): works(
        MESSAGES + "test_gguf_blocks_thinking_the_prompt_opens_is_reasoning_content",
        note="A grammar with the parser needs `<think>` to be one token, which the bundled "
        "model's tokenizer lacks: a 400 naming `response_format` "
        "(tests/test_reasoning_server.py::test_grammar_refused_where_think_is_not_one_token).",
    ),
    ("int8", "reasoning"): works(R_INT8),
    ("lora", "reasoning"): works(M_ADAPTER),
    ("spec", "reasoning"): works(
        "tests/test_reasoning_grammar.py::test_ngram_drafts_across_the_end_of_thinking",
        MESSAGES + "test_a_message_runs_with_accepted_drafts",
        note="Drafts are cut at `</think>`, where the grammar starts.",
    ),
    ("structured", "reasoning"): works(
        "tests/test_reasoning_server.py::test_json_schema_applies_after_the_thinking",
        "tests/test_reasoning_grammar.py::test_choice_applies_after_the_thinking_the_model_opens",
        REASONING + "test_a_grpc_grammar_applies_after_the_thinking",
        note="The grammar applies to the answer after `</think>`, never to the thinking.",
    ),
    ("grpc", "reasoning"): works(
        R_GRPC,
        REASONING + "test_a_grpc_grammar_applies_after_the_thinking",
        "tests/test_reasoning_server.py::test_default_kwargs_reach_grpc_chats",
        note="gRPC chats (`messages`) get `reasoning_content`; a `prompt` is not split, as "
        "on completions.",
    ),
    ("router", "reasoning"): works(R_SHARDED),
    ("reasoning", "cuda"): not_run(NO_GPU),
    # -- embeddings (--runner pooling) -------------------------------------------------------
    ("tp", "embed"): works(
        EMBEDDINGS + "test_tiny_random_model_one_and_two_ranks_match_transformers"
    ),
    ("gguf", "embed"): works(EMBEDDINGS + "test_bundled_gguf_blocks_match_transformers"),
    ("int8", "embed"): works(EMBED + "test_int8_weights_embed_like_float32"),
    ("lora", "embed"): works(EMBEDDINGS + "test_a_lora_adapter_embeds_like_peft_merged"),
    ("spec", "embed"): refused(
        "speculative decoding has nothing to speed up with --runner pooling",
        EMBEDDINGS + "test_what_a_pooling_engine_refuses",
        note="A pooling runner only prefills: there are no decode steps to draft for.",
    ),
    ("structured", "embed"): refused(
        UNRECOGNIZED.format("response_format"),
        EMBEDDINGS + "test_hostile_requests_are_400_naming_the_field[response_format]",
        note="Nothing is generated to constrain: a 400 naming `response_format`.",
    ),
    ("grpc", "embed"): refused(
        "this server embeds (--runner pooling): it serves /v1/embeddings, not text generation",
        EMBEDDINGS + "test_grpc_generate_is_refused_on_a_pooling_server",
        note="INVALID_ARGUMENT: embeddings are an HTTP route; gRPC serves generation only.",
    ),
    ("router", "embed"): works(EMBEDDINGS + "test_the_router_forwards_embeddings"),
    ("reasoning", "embed"): refused(
        "--reasoning-parser has nothing to parse with --runner pooling",
        EMBED + "test_a_reasoning_parser_with_the_pooling_runner_is_refused_at_start",
    ),
    ("embed", "cuda"): not_run(NO_GPU),
    # -- the Anthropic Messages API (/v1/messages) -------------------------------------------
    ("tp", "messages"): works(R_MESSAGES),
    ("gguf", "messages"): works(MESSAGES + "test_gguf_blocks_answer_a_message_as_chat"),
    ("int8", "messages"): works(R_INT8),
    ("lora", "messages"): works(M_ADAPTER, note="`model` names the adapter."),
    ("spec", "messages"): works(MESSAGES + "test_a_message_runs_with_accepted_drafts"),
    ("structured", "messages"): works(
        "tests/test_anthropic_messages.py::test_a_forced_tool_gives_a_tool_use_block",
        note="Anthropic's API has no `response_format`: a forced tool (`tool_choice` `any` "
        "or `tool`) is the grammar-constrained output.",
    ),
    ("grpc", "messages"): works(
        R_GRPC,
        note="One server answers `/v1/messages` and gRPC chats with the same text; the "
        "Messages API itself is HTTP only.",
    ),
    ("router", "messages"): works(
        "tests/test_anthropic_messages.py::test_the_router_forwards_both_routes", R_MESSAGES
    ),
    ("reasoning", "messages"): works(
        "tests/test_anthropic_messages.py::test_reasoning_comes_back_as_a_thinking_block",
        note="The thinking is a `thinking` block, the answer a `text` block.",
    ),
    ("embed", "messages"): refused(
        "this server embeds (--runner pooling): it serves /v1/embeddings, not text generation",
        EMBED + "test_messages_are_refused_on_a_pooling_server",
    ),
    ("messages", "cuda"): not_run(NO_GPU),
    # -- priority scheduling (--scheduling-policy priority) ----------------------------------
    ("tp", "priority"): works(T_SHARDED, R_SHARDED),
    ("gguf", "priority"): works(TOKEN_IO + "test_with_gguf_blocks"),
    ("int8", "priority"): works(R_INT8),
    ("lora", "priority"): works(
        TOKEN_IO + "test_with_lora",
        note="A request still waits for an adapter slot; it preempts only for KV blocks or "
        "`--max-num-seqs`.",
    ),
    ("spec", "priority"): works(
        TOKEN_IO + "test_with_speculative_decoding",
        note="A preempted request's drafts are dropped.",
    ),
    ("structured", "priority"): works(TOKEN_IO + "test_with_structured_output"),
    ("grpc", "priority"): works(
        "tests/test_priority_server.py::test_priority_on_chat_responses_and_grpc",
        "tests/test_priority_server.py::test_grpc_priority_on_a_fcfs_server_is_invalid_argument",
    ),
    ("router", "priority"): works(
        T_SHARDED,
        R_SHARDED,
        note="The router passes `priority` on; each worker orders its own requests, the "
        "router does not order them across workers.",
    ),
    ("reasoning", "priority"): works(R_SHARDED, R_INT8),
    ("embed", "priority"): works(
        EMBED + "test_priority_is_taken_and_keeps_the_vectors",
        EMBED + "test_hostile_priorities_are_400s_naming_priority[float]",
    ),
    ("messages", "priority"): works(
        R_MESSAGES,
        R_INT8,
        MESSAGES + "test_priority_on_messages_is_checked_as_on_chat[nonzero-on-fcfs]",
        note="`priority` is a nanollmserve extension of `/v1/messages`, checked as on chat.",
    ),
    ("priority", "cuda"): not_run(NO_GPU),
    # -- token-level I/O (return_token_ids, prompt_logprobs, token-id prompts) --------------
    ("tp", "tokenio"): works(T_SHARDED),
    ("gguf", "tokenio"): works(TOKEN_IO + "test_with_gguf_blocks"),
    ("int8", "tokenio"): works(R_INT8),
    ("lora", "tokenio"): works(TOKEN_IO + "test_with_lora"),
    ("spec", "tokenio"): works(TOKEN_IO + "test_with_speculative_decoding"),
    ("structured", "tokenio"): works(
        TOKEN_IO + "test_with_structured_output",
        note="Prompt logprobs are the raw model's: no grammar applies to the prompt.",
    ),
    ("grpc", "tokenio"): works(
        R_GRPC,
        REASONING + "test_grpc_prompt_logprobs_beyond_the_limit_are_invalid_argument",
        note="`return_token_ids` and `sampling.prompt_logprobs`, equal to HTTP's.",
    ),
    ("router", "tokenio"): works(T_SHARDED, R_SHARDED),
    ("reasoning", "tokenio"): works(R_SHARDED, R_GRPC),
    ("embed", "tokenio"): works(
        EMBED + "test_token_id_inputs_embed_like_their_text_and_generation_fields_are_refused",
        note="Token-id inputs embed like their text; `return_token_ids` and "
        "`prompt_logprobs` are generation fields, a 400 naming them.",
    ),
    ("messages", "tokenio"): refused(
        UNRECOGNIZED.format("return_token_ids"),
        MESSAGES + "test_token_level_fields_are_refused_on_messages[return_token_ids]",
        MESSAGES + "test_token_level_fields_are_refused_on_messages[prompt_logprobs]",
        note="Anthropic's message has no place for token ids or logprobs: a 400 "
        "`invalid_request_error` naming the field.",
    ),
    ("priority", "tokenio"): works(TOKEN_IO + "test_with_gguf_blocks", T_SHARDED),
    ("tokenio", "cuda"): not_run(NO_GPU),
    # -- the step flight recorder (--step-record, /debug/steps, replay) ----------------------
    ("tp", "recorder"): works(RECORDER_COMPAT + "test_tensor_parallel_records_and_replays"),
    ("gguf", "recorder"): works(REC_STACK),
    ("int8", "recorder"): works(REC_INT8, REC_REPLAY),
    ("lora", "recorder"): works(
        RECORDER_COMPAT + "test_lora_requests_are_recorded_and_replay_refuses_them",
        note="Recorded with the adapter's name; `replay` refuses the record (exit 2 naming "
        "the adapter): a record does not hold adapters.",
    ),
    ("spec", "recorder"): works(
        REC_SPEC,
        REC_STACK,
        note="Drafts proposed and accepted are recorded and compared by `replay`.",
    ),
    ("structured", "recorder"): works(REC_SPEC),
    ("grpc", "recorder"): works(
        "tests/test_flight_recorder_server.py::"
        "test_every_frontends_requests_are_recorded_and_since_filters"
    ),
    ("router", "recorder"): works(
        REC_STACK, note="The router forwards `/debug/steps` to its worker."
    ),
    ("reasoning", "recorder"): works(REC_INT8, REC_REPLAY),
    ("embed", "recorder"): works(
        COMPAT_RECORDER + "test_embeddings_are_recorded_and_replay",
        note="A pooling runner's prefill-only steps are recorded and replay.",
    ),
    ("messages", "recorder"): works(
        COMPAT_RECORDER + "test_an_anthropic_message_is_recorded", REC_REPLAY
    ),
    ("priority", "recorder"): works(
        RECORDER + "test_a_priority_preemption_mid_run_is_recorded_with_its_reason_and_replays"
    ),
    ("tokenio", "recorder"): works(
        REC_INT8,
        REC_REPLAY,
        note="`prompt_logprobs` and the prompt's token ids are in the recorded arrival.",
    ),
    ("recorder", "cuda"): not_run(NO_GPU),
    # -- OpenTelemetry request spans (--otlp-traces-endpoint) --------------------------------
    ("tp", "tracing"): works(TRACE_SHARDED),
    ("gguf", "tracing"): works(TRACING + "test_the_bundled_models_gguf_blocks_are_traced"),
    ("int8", "tracing"): works(REC_INT8),
    ("lora", "tracing"): works(
        TRACING + "test_a_lora_request_names_its_adapter",
        note="`gen_ai.request.model` names the adapter.",
    ),
    ("spec", "tracing"): works(
        TRACING + "test_structured_output_with_speculative_decoding_is_traced"
    ),
    ("structured", "tracing"): works(
        TRACING + "test_structured_output_with_speculative_decoding_is_traced"
    ),
    ("grpc", "tracing"): works(TRACING + "test_grpc_calls_are_spans_in_the_callers_trace"),
    ("router", "tracing"): works(
        "tests/test_tracing_router.py::"
        "test_one_trace_shows_router_then_worker_from_the_clients_parent",
        note="One trace: the router's CLIENT span, then the worker's SERVER span.",
    ),
    ("reasoning", "tracing"): works(TRACE_SHARDED, REC_INT8),
    ("embed", "tracing"): works(TRACING + "test_embeddings_span"),
    ("messages", "tracing"): works(
        TRACING + "test_responses_and_messages_are_chat_spans_and_other_routes_have_none",
        note="A message is a `chat` span.",
    ),
    ("priority", "tracing"): works(TRACE_SHARDED, REC_INT8),
    ("tokenio", "tracing"): works(TRACE_SHARDED, REC_INT8),
    ("recorder", "tracing"): works(
        REC_INT8, note="Both on in one server: the request is one span and one arrival."
    ),
    ("tracing", "cuda"): not_run(NO_GPU),
    # -- the quantized KV cache (--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2) -------------------
    ("tp", "kvdtype"): works(
        "tests/test_tensor_parallel.py::test_a_quantized_kv_cache_shards_like_one_rank[int8]",
        "tests/test_tensor_parallel.py::test_a_quantized_kv_cache_shards_like_one_rank[fp8_e4m3]",
        note="Each rank quantizes its own KV heads; two ranks answer as one (int8 and fp8).",
    ),
    ("gguf", "kvdtype"): works(
        KV_DTYPE + "test_perplexity_with_int8_kv_is_within_half_a_percent",
        KV_DTYPE + "test_float16_kv_keeps_float32s_perplexity_and_greedy_answers",
        "tests/test_kv_cache_dtype_server.py::test_http_and_grpc_answer_from_an_int8_pool",
        note="Under the blocks `auto` is a float16 pool (decision 37); float16 and int8 K/V "
        "run the native step on the blocks; fp8 runs the PyTorch forward.",
    ),
    ("int8", "kvdtype"): works(KV_STACK, KV_SLEEP),
    ("lora", "kvdtype"): works(KV_DTYPE + "test_lora_on_int8"),
    ("spec", "kvdtype"): works(
        KV_DTYPE + "test_ngram_speculative_decoding_on_int8",
        note="Tested with ngram drafts; a draft model keeps its own pool in its model dtype.",
    ),
    ("structured", "kvdtype"): works(KV_DTYPE + "test_structured_output_on_int8"),
    ("grpc", "kvdtype"): works(
        "tests/test_kv_cache_dtype_server.py::test_http_and_grpc_answer_from_an_int8_pool"
    ),
    ("router", "kvdtype"): works(
        MEMORY_SERVER + "test_the_router_in_front_of_an_int8_kv_worker_answers_as_the_worker",
        note="Each worker chooses its own pool dtype.",
    ),
    ("reasoning", "kvdtype"): works(KV_STACK, KV_SLEEP),
    ("embed", "kvdtype"): works(
        MEMORY + "test_the_pooling_runner_embeds_from_an_int8_kv_cache_like_float32",
        note="A prefill from position 0 attends to its own K/V before they are quantized.",
    ),
    ("messages", "kvdtype"): works(MEMORY + "test_an_int8_kv_cache_answers_an_anthropic_message"),
    ("priority", "kvdtype"): works(KV_STACK),
    ("tokenio", "kvdtype"): works(KV_STACK, KV_SLEEP),
    ("recorder", "kvdtype"): works(KV_STACK, KV_REPLAY),
    ("tracing", "kvdtype"): works(KV_STACK),
    ("kvdtype", "cuda"): not_run(NO_GPU),
    # -- sleep mode (--enable-sleep-mode, --sleep-idle-seconds) ------------------------------
    ("tp", "sleep"): refused(
        "enable_sleep_mode is not supported with tensor parallelism",
        SLEEP + "test_sleep_mode_with_tensor_parallelism_is_refused_at_start[argv0]",
        SLEEP + "test_sleep_mode_with_tensor_parallelism_is_refused_at_start[argv1]",
        note="The other ranks hold their own pools; `--sleep-idle-seconds` is refused alike.",
    ),
    ("gguf", "sleep"): works(
        SLEEP + "test_gguf_blocks_and_the_native_step_across_a_sleep[1]",
        SLEEP + "test_gguf_blocks_and_the_native_step_across_a_sleep[2]",
        note="The native step is rebuilt on the new pool; level 2 reloads the blocks.",
    ),
    ("int8", "sleep"): works(KV_SLEEP, note="Level 2 reloads and quantizes the weights again."),
    ("lora", "sleep"): works(
        SLEEP + "test_lora_across_a_sleep_level_1_and_level_2_refused",
        note="Level 1; level 2 is a 400 (`sleep level 2 is not supported with LoRA adapters`).",
    ),
    ("spec", "sleep"): works(
        SLEEP + "test_speculative_decoding_across_a_sleep[ngram]",
        SLEEP + "test_speculative_decoding_across_a_sleep[draft_model]",
        note="ngram at both levels; a draft model at level 1 (level 2 is a 400).",
    ),
    ("structured", "sleep"): works(SLEEP + "test_structured_output_across_a_sleep"),
    ("grpc", "sleep"): works(
        SLEEP_SERVER + "test_grpc_requests_while_asleep_are_unavailable",
        note="Calls while asleep end with `UNAVAILABLE`; the sleep routes are HTTP only.",
    ),
    ("router", "sleep"): works(
        SLEEP_SERVER + "test_the_router_passes_a_sleeping_workers_503_on",
        note="A sleeping worker's 503 is retried on another worker or passed on.",
    ),
    ("reasoning", "sleep"): works(KV_SLEEP),
    ("embed", "sleep"): works(
        MEMORY + "test_the_pooling_runner_embeds_the_same_across_a_sleep[1]",
        MEMORY + "test_the_pooling_runner_embeds_the_same_across_a_sleep[2]",
    ),
    ("messages", "sleep"): works(
        KV_SLEEP, note="While asleep `/v1/messages` is a 503 too; after the wake, the same text."
    ),
    ("priority", "sleep"): works(KV_SLEEP),
    ("tokenio", "sleep"): works(
        KV_SLEEP, note="The same token ids and prompt logprobs before the sleep and after."
    ),
    ("recorder", "sleep"): works(
        KV_REPLAY,
        note="A sleep is recorded (`sleeps` in the next step) and replayed: the prefix cache "
        "it emptied stays empty in the replay.",
    ),
    ("tracing", "sleep"): works(KV_SLEEP),
    ("kvdtype", "sleep"): works(
        KV_DTYPE + "test_sleep_and_wake_keep_the_int8_cache",
        KV_SLEEP,
        note="The wake makes a fresh pool of the same dtype.",
    ),
    ("sleep", "cuda"): not_run(NO_GPU),
    # -- the KV offload directory (--kv-offload-dir) -----------------------------------------
    ("tp", "offload"): refused(
        "kv_offload_dir is not supported with tensor parallelism",
        OFFLOAD_REFUSED.format("tensor-parallel"),
        note="Each rank holds a shard of the KV heads.",
    ),
    ("gguf", "offload"): works(
        OFFLOAD + "test_a_new_engine_loads_the_blocks_the_last_one_wrote[auto]",
        OFFLOAD + "test_blocks_of_another_dtype_weight_format_or_layout_never_load[weight-format]",
        note="The weight format is in the key: dense and GGUF-block K/V never mix; the "
        "GGUF blocks' pool is float16 (`auto`), its dtype in the key too.",
    ),
    ("int8", "offload"): works(STORE_STACK),
    ("lora", "offload"): works(
        OFFLOAD + "test_blocks_are_kept_apart_by_adapter_and_cache_salt",
        note="The adapter's weights are in the key.",
    ),
    ("spec", "offload"): works(
        OFFLOAD + "test_speculative_decoding_reads_the_store_too",
        note="Only accepted tokens' blocks are written.",
    ),
    ("structured", "offload"): works(MEMORY + "test_a_schema_constrained_chat_reads_the_store"),
    ("grpc", "offload"): works(
        MEMORY_SERVER + "test_grpc_reads_a_prefix_from_the_store_after_the_pool_forgot_it"
    ),
    ("router", "offload"): works(
        MEMORY_SERVER + "test_the_router_in_front_of_a_store_worker_gets_the_prefix_from_the_store",
        note="Each worker has its own pool; give each its own directory.",
    ),
    ("reasoning", "offload"): works(STORE_STACK),
    ("embed", "offload"): refused(
        "kv_offload_dir extends the prefix cache: it needs prefix caching on",
        OFFLOAD_REFUSED.format("pooling"),
        note="A pooling runner caches no prefixes.",
    ),
    ("messages", "offload"): works(MEMORY + "test_a_message_reads_the_store"),
    ("priority", "offload"): works(STORE_STACK),
    ("tokenio", "offload"): works(
        STORE_STACK,
        note="A request with `prompt_logprobs` computes its whole prompt (no hit is read; "
        "test_compat_memory.py's test_prompt_logprobs_compute_the_prompt_instead_of_reading_"
        "the_store checks it).",
    ),
    ("recorder", "offload"): works(
        STORE_REPLAY,
        note="A replay reads no directory unless `replay --kv-offload-dir DIR` names one: a "
        "prefix the server read from it is computed, and the replay says where it differs.",
    ),
    ("tracing", "offload"): works(STORE_STACK),
    ("kvdtype", "offload"): refused(
        "kv_cache_dtype fp8 is not supported with kv_offload_dir",
        KV_REFUSED.format("engine_args0-kv_offload_dir"),
        note="The block file format has no scales yet; int8 is refused alike.",
    ),
    ("sleep", "offload"): works(
        OFFLOAD + "test_after_sleep_the_empty_pool_refills_from_the_store[1]",
        OFFLOAD + "test_after_sleep_the_empty_pool_refills_from_the_store[2]",
        SLEEP + "test_the_kv_offload_tier_outlives_a_sleep[1]",
        note="The sleep forgets the pool's prefixes, not the directory's.",
    ),
    ("offload", "cuda"): not_run(NO_GPU),
    # -- prefill/decode disaggregation (router --policy pd, serve --kv-role) ----------------
    # "works": the request ran phase 1 on the prefill worker (the router's phase-1 counter)
    # and the decode worker read its blocks (`cached_tokens`), and the answer equals the
    # decode worker's own greedy answer to it with nothing cached.
    ("tp", "pd"): refused(
        "kv_offload_dir is not supported with tensor parallelism",
        "tests/test_pd_worker.py::test_a_role_with_tensor_parallelism_is_refused_at_start",
        note="A prefill or decode role needs the block store, which a sharded worker lacks.",
    ),
    ("gguf", "pd"): works(
        PD_GGUF, note="Both roles run the bundled model's GGUF blocks on float16 pools (`auto`)."
    ),
    ("int8", "pd"): works(PD_INT8),
    ("lora", "pd"): works(
        PD + "test_an_adapter_runs_both_phases",
        note="`model` names the adapter in both phases; its blocks are keyed by the adapter.",
    ),
    ("spec", "pd"): works(
        PD + "test_ngram_drafts_run_on_the_decode_worker",
        note="Phase 1 is one token (no drafts); the decode worker drafts.",
    ),
    ("structured", "pd"): works(
        PD + "test_a_json_schema_holds_through_pd",
        PD_CLUSTER + "test_structured_output_through_pd",
        note="Both phases carry the grammar; phase 1's one token is constrained too.",
    ),
    ("grpc", "pd"): refused(
        "unrecognized arguments: --grpc-port",
        PD + "test_the_pd_router_has_no_grpc_port",
        note="Disaggregation is the router's, which speaks HTTP only, and "
        "`kv_transfer_params` is not a gRPC field: a worker's own `--grpc-port` answers "
        "without phase 1.",
    ),
    ("router", "pd"): works(
        PD_GREEDY, PD_GGUF, note="`--policy pd` is a router policy (`cluster` starts one)."
    ),
    ("reasoning", "pd"): works(
        PD_INT8, note="A thinking block the prompt opens comes back as `reasoning_content`."
    ),
    ("embed", "pd"): refused(
        "kv_offload_dir extends the prefix cache: it needs prefix caching on",
        PD_REFUSED.format("pooling"),
        PD + "test_embeddings_through_pd_are_a_400",
        note="A pooling runner cannot take a role; `/v1/embeddings` through a pd router "
        "reaches a generating decode worker: a 400 naming `--runner pooling`.",
    ),
    ("messages", "pd"): works(
        PD + "test_messages_are_served_by_a_decode_worker_without_phase_1",
        note="Served by a decode worker without phase 1 (the decode worker prefills the "
        "prompt itself); the answer equals the disaggregated chat completion's.",
    ),
    ("priority", "pd"): works(
        PD + "test_priority_is_taken_by_both_phases",
        note="Each worker orders its own phase; a hostile `priority` is phase 1's 400.",
    ),
    ("tokenio", "pd"): works(
        PD + "test_token_level_io_through_pd",
        PD_GREEDY,
        note="Token-id prompts and `return_token_ids` read the store; a request with "
        "`prompt_logprobs` runs phase 1 but the decode worker computes its whole prompt.",
    ),
    ("recorder", "pd"): works(
        PD + "test_both_workers_record_their_phase",
        note="Each worker records its own phase: phase 1 (`max_tokens` 1) on the prefill "
        "worker, the answer on the decode worker.",
    ),
    ("tracing", "pd"): works(
        PD + "test_one_trace_holds_both_phases",
        note="One trace: the router's span with a call per phase, and each worker's span.",
    ),
    ("kvdtype", "pd"): refused(
        "kv_cache_dtype int8 is not supported with kv_offload_dir",
        PD_REFUSED.format("kv-cache-dtype"),
        note="The block format has no scales; fp8 is refused alike.",
    ),
    ("sleep", "pd"): works(
        PD + "test_a_sleeping_worker_under_pd",
        note="A sleeping prefill worker's 503 falls back (the decode worker prefills); a "
        "sleeping decode worker's 503 is the client's; the store outlives the sleep.",
    ),
    ("offload", "pd"): works(
        PD_GREEDY,
        PD_GGUF,
        note="The store is the transport: `cluster` makes one under /dev/shm, or the "
        "workers share one `--kv-offload-dir`.",
    ),
    ("pd", "cuda"): not_run(NO_GPU),
    # -- llama.cpp's native API (POST /completion) -------------------------------------------
    # "works": a `/completion` answer in llama.cpp's shape whose `timings` agree with its
    # `tokens_predicted` and `tokens_evaluated`, from a server where the other feature acted.
    ("tp", "llamacpp"): works(R_MESSAGES),
    ("gguf", "llamacpp"): works(
        LLAMACPP + "test_greedy_text_matches_the_openai_route_and_the_fields_add_up"
    ),
    ("int8", "llamacpp"): works(L_RECORDED),
    ("lora", "llamacpp"): works(
        M_ADAPTER, note="`model` names the adapter, as on the OpenAI routes."
    ),
    ("spec", "llamacpp"): works(L_DRAFTS),
    ("structured", "llamacpp"): works(
        LLAMACPP + "test_json_schema_and_grammar_constrain_the_output",
        note="llama.cpp's `json_schema` and `grammar` (GBNF); both at once is a 400 naming "
        "`grammar`.",
    ),
    ("grpc", "llamacpp"): works(
        R_GRPC,
        note="One server answers a prompt over gRPC and on `/completion` with the same "
        "tokens; the native API itself is HTTP only.",
    ),
    ("router", "llamacpp"): works(
        R_MESSAGES, note="The router forwards `/completion` as it forwards any path."
    ),
    ("reasoning", "llamacpp"): works(
        L_DRAFTS,
        L_RECORDED,
        note="`/completion` takes a prompt: its text comes back unsplit (`<think>` in "
        "`content`), as on `/v1/completions`; the same server's chats and messages split it.",
    ),
    ("embed", "llamacpp"): refused(
        "this server embeds (--runner pooling): it serves /v1/embeddings, not text generation",
        EMBED + "test_llamacpp_completion_is_refused_on_a_pooling_server",
    ),
    ("messages", "llamacpp"): works(
        L_RECORDED,
        note="One server answers `/v1/messages` and `/completion`, each in its own shape.",
    ),
    ("priority", "llamacpp"): refused(
        UNRECOGNIZED.format("priority"),
        LLAMACPP + "test_priority_is_not_a_completion_field[zero]",
        LLAMACPP + "test_priority_is_not_a_completion_field[one]",
        R_MESSAGES,
        note="llama.cpp's `/completion` has no `priority` (a nanollmserve extension of the "
        "OpenAI and Anthropic routes): like any field it does not declare, a 400 naming it, "
        "on a `--scheduling-policy priority` worker too.",
    ),
    ("tokenio", "llamacpp"): works(
        LLAMACPP + "test_prompt_as_token_ids",
        note="llama.cpp's names: a token-id `prompt`, `return_tokens` (`tokens`); no prompt "
        "logprobs on `/completion`.",
    ),
    ("recorder", "llamacpp"): works(
        L_RECORDED,
        note="Recorded like any request; the record replays "
        f"(`{REC_REPLAY.partition('::')[2]}` replays the same record).",
    ),
    ("tracing", "llamacpp"): works(L_RECORDED, note="A `/completion` is a `text_completion` span."),
    ("kvdtype", "llamacpp"): works(KV_SLEEP),
    ("sleep", "llamacpp"): works(
        KV_SLEEP,
        note="While asleep `/completion` is a 503 `engine_sleeping` too; after the wake, the "
        "same tokens, computed again.",
    ),
    ("offload", "llamacpp"): works(
        MEMORY + "test_a_llamacpp_completion_reads_the_store",
        note="`tokens_cached` and `timings.cache_n` count the tokens read from the store.",
    ),
    ("pd", "llamacpp"): works(
        PD + "test_llamacpp_completion_is_served_by_a_decode_worker_without_phase_1",
        note="`/completion` is not one of the router's two-phase paths: a decode worker "
        "serves it without phase 1, prefilling the prompt itself (as `/v1/messages`); the "
        "answer equals the disaggregated `/v1/completions` one.",
    ),
    ("llamacpp", "cuda"): not_run(NO_GPU),
}

MARKS = {"works": "✅", "refused": "⛔", "not run": "❔"}


def ordered_pairs() -> list[tuple[str, str]]:
    return list(combinations(FEATURES, 2))


def cell_problems() -> list[str]:
    """Pairs without a cell, and cells without the evidence their state needs."""
    problems = []
    pairs = ordered_pairs()
    for pair in CELLS:
        if pair not in pairs:
            problems.append(f"{pair}: not a pair of FEATURES in their order")
    for a, b in pairs:
        cell = CELLS.get((a, b))
        name = f"{FEATURES[a]} x {FEATURES[b]}"
        if cell is None:
            problems.append(f"{name}: no cell (needs a test id or a tested refusal)")
        elif cell.state == "not run":
            if not NOT_RUN_ALLOWED & {a, b}:
                problems.append(f"{name}: 'not run' is only allowed for {NOT_RUN_ALLOWED}")
        elif not cell.tests:
            problems.append(f"{name}: {cell.state} without a test id")
        elif cell.state == "refused" and not cell.error:
            problems.append(f"{name}: refused without the error text")
    return problems


def split_test_id(test_id: str) -> tuple[str, str]:
    path, _, name = test_id.partition("::")
    return path, name.partition("[")[0]


def missing_tests(root: Path) -> list[str]:
    """Named test ids whose file or test function does not exist (a static, fast look)."""
    problems = []
    for test_id in sorted({t for cell in CELLS.values() for t in cell.tests}):
        path, function = split_test_id(test_id)
        source = root / path
        if not source.is_file():
            problems.append(f"{test_id}: no file {path}")
        elif not re.search(rf"^def {re.escape(function)}\(", source.read_text(), re.MULTILINE):
            problems.append(f"{test_id}: no test function {function} in {path}")
    return problems


def uncollected_tests(root: Path) -> list[str]:
    """Named test ids (parameters included) that pytest does not collect."""
    test_ids = {t for cell in CELLS.values() for t in cell.tests}
    files = sorted({split_test_id(t)[0] for t in test_ids})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    return [f"{t}: not collected by pytest" for t in sorted(test_ids - collected)]


def render() -> str:
    """The page: the grid (each mark numbered), then one numbered line of evidence per pair."""
    keys = list(FEATURES)
    number = {pair: i for i, pair in enumerate(ordered_pairs(), start=1)}
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by scripts/compat_matrix.py from its CELLS table: edit the table, then",
        "     run `.venv/bin/python scripts/compat_matrix.py`. `make check` fails when this",
        "     page is out of date, a cell lacks a test, or a named test is not collected;",
        "     `scripts/compat_matrix.py --collect` runs the named tests and fails a cell whose",
        "     test fails or does not show both features acting (tests/compat_evidence.py). -->",
        "",
        "Which features run together. Every cell is backed by a test: ✅ a test runs the two",
        "together and shows each one acted (drafts were made, the adapter changed the output,",
        "a span arrived, ...); ⛔ the pair is refused with one clear error, and a test checks",
        "that error; ❔ not run: CUDA, which no machine of this project has (nothing on CUDA is",
        "claimed as tested). The number in a cell is the line below that names the tests.",
        "",
        "| | " + " | ".join(FEATURES[k] for k in keys) + " |",
        "| --- |" + " :---: |" * len(keys),
    ]
    for row in keys:
        marks = []
        for column in keys:
            if row == column:
                marks.append("—")
                continue
            pair = (row, column) if (row, column) in number else (column, row)
            marks.append(f"{MARKS[CELLS[pair].state]} {number[pair]}")
        lines.append(f"| **{FEATURES[row]}** | " + " | ".join(marks) + " |")
    lines += ["", "## Evidence per pair", ""]
    for pair, n in number.items():
        cell = CELLS[pair]
        what = f"refused: `{cell.error}`" if cell.state == "refused" else cell.state
        line = f"{n}. **{FEATURES[pair[0]]} x {FEATURES[pair[1]]}**: {what}."
        if cell.note:
            line += f" {cell.note}"
        if cell.tests:
            line += " Tests: " + ", ".join(f"`{t}`" for t in cell.tests) + "."
        lines.append(line)
    return "\n".join(lines) + "\n"


def selected_cells(names: list[str]) -> dict[tuple[str, str], Cell]:
    """The cells named `a,b` (either order); every cell with tests when none is named."""
    if not names:
        return {pair: cell for pair, cell in CELLS.items() if cell.tests}
    chosen = {}
    for name in names:
        a, _, b = name.partition(",")
        pair = (a, b) if (a, b) in CELLS else (b, a)
        if pair not in CELLS:
            raise SystemExit(f"compat_matrix: --cell {name}: no such cell")
        chosen[pair] = CELLS[pair]
    return chosen


def run_tests(root: Path, test_ids: list[str], timeout: float) -> tuple[dict, str]:
    """Run `test_ids` with pytest, writing the evidence file: (evidence, pytest's output)."""
    with tempfile.TemporaryDirectory(prefix="compat-evidence-") as tmp:
        path = Path(tmp) / "evidence.json"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += ["--compat-evidence", str(path), *test_ids]
        try:
            proc = subprocess.run(
                command, cwd=root, capture_output=True, text=True, timeout=timeout, check=False
            )
            output = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as expired:
            partial = expired.stdout or b""
            if isinstance(partial, bytes):
                partial = partial.decode(errors="replace")
            output = f"pytest ran past {timeout:.0f} s and was stopped\n{partial}"
        evidence = json.loads(path.read_text()) if path.is_file() else {}
    return evidence, output


def evidence_problems(cells: dict[tuple[str, str], Cell], evidence: dict) -> list[str]:
    """What the run's evidence lacks, one line per cell and test."""
    problems = []
    for (a, b), cell in cells.items():
        name = f"{FEATURES[a]} x {FEATURES[b]} ({a},{b}, {cell.state})"
        errors_seen = []
        for test_id in cell.tests:
            entry = evidence.get(test_id)
            if entry is None or entry["outcome"] is None:
                problems.append(f"{name}: {test_id}: did not run (not collected?)")
                continue
            if entry["outcome"] != "passed":
                problems.append(f"{name}: {test_id}: {entry['outcome']}")
                continue
            if cell.state == "works":
                missing = [f for f in (a, b) if f not in entry["features"]]
                if missing:
                    problems.append(
                        f"{name}: {test_id}: passed without showing "
                        + " and ".join(missing)
                        + ' (compat.exercised("'
                        + missing[0]
                        + '", ...) with its proof)'
                    )
            else:
                seen = [r["error"] for r in entry["refused"] if set(r["pair"]) == {a, b}]
                if not seen:
                    problems.append(
                        f"{name}: {test_id}: passed without recording the refusal "
                        f'(compat.refused("{a}", "{b}", error))'
                    )
                errors_seen += seen
        if (
            cell.state == "refused"
            and errors_seen
            and not any(cell.error in e for e in errors_seen)
        ):
            problems.append(f"{name}: no test saw the error {cell.error!r}: {errors_seen}")
    return problems


def read_evidence(paths: list[Path]) -> dict:
    """The evidence files of earlier runs (`pytest --compat-evidence`), merged: a test that
    ran in one and not another keeps its entry from the run that ran it."""
    merged: dict = {}
    for path in paths:
        for test_id, entry in json.loads(path.read_text()).items():
            if merged.get(test_id, {}).get("outcome") is None:
                merged[test_id] = entry
    return merged


def collect(
    root: Path, names: list[str], evidence_files: list[Path], timeout: float = 3 * 3600
) -> list[str]:
    """Check the evidence of the cells `names` (all when empty): from `evidence_files` when
    given (the test runs wrote them; nothing is run again), else from running their tests."""
    cells = selected_cells(names)
    test_ids = sorted({t for cell in cells.values() for t in cell.tests})
    if evidence_files:
        evidence, output = read_evidence(evidence_files), ""
        print(f"compat_matrix: read the evidence of {len(test_ids)} tests of {len(cells)} cells")
    else:
        started = time.monotonic()
        evidence, output = run_tests(root, test_ids, timeout)
        took = time.monotonic() - started
        print(f"compat_matrix: ran {len(test_ids)} tests of {len(cells)} cells in {took:.0f} s")
    problems = evidence_problems(cells, evidence)
    if problems and output:
        print(output[-8000:])
    return problems


def check(root: Path, collect_only: bool = False) -> list[str]:
    problems = cell_problems() + missing_tests(root)
    page = root / PAGE
    if not problems and (not page.is_file() or page.read_text() != render()):
        problems.append(f"{PAGE}: out of date; run .venv/bin/python scripts/compat_matrix.py")
    if collect_only and not problems:
        problems += uncollected_tests(root)
    return problems


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    if not argv:
        (root / PAGE).write_text(render())
        print(f"compat_matrix: wrote {PAGE}")
        return 0
    known = {"--check", "--collect-only", "--collect", "--cell", "--evidence"}
    if unknown := [a for a in argv if a.startswith("-") and a not in known]:
        print(f"compat_matrix: unknown option(s) {unknown}; see the module's docstring")
        return 2
    names = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--cell"]
    evidence_files = [Path(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--evidence"]
    if missing := [str(path) for path in evidence_files if not path.is_file()]:
        print(f"compat_matrix: no evidence file {missing}")
        return 2
    problems = check(root, collect_only="--collect-only" in argv)
    if "--collect" in argv and not problems:
        problems = collect(root, names, evidence_files)
    for problem in problems:
        print(f"compat_matrix: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
