"""The one model cadence serves over the Open Inference Protocol, and how its requests map
onto cadence's own.

The model is decoupled: a request gets one response per chunk of output, so it is reached
through `ModelStreamInfer` only. Its tensors (docs/kserve.md has the full table):

- inputs: PROMPT (BYTES [1], UTF-8 text) or PROMPT_TOKEN_IDS (INT32 [-1]), MAX_TOKENS
  (INT32 [1]); optional TEMPERATURE, TOP_P (FP32 [1]), TOP_K (INT32 [1]), SEED (UINT64 [1]),
  STOP_TOKEN_IDS (INT32 [-1]). Any integer datatype is accepted where INT32 is declared, and
  FP64 where FP32 is, so clients need not match the width exactly.
- outputs: TOKEN_IDS (INT32 [-1], the chunk's tokens) and TEXT (BYTES [1], their text).
"""

from __future__ import annotations

from typing import NamedTuple

from cadence.core.errors import InvalidRequest
from cadence.core.requests import Request
from cadence.proto.kserve import grpc_service_pb2 as kpb
from cadence.proto.kserve import model_config_pb2 as mpb
from cadence.proto.kserve.tensors import FLOAT_TYPES, INTEGER_TYPES, TensorError, decode_input
from cadence.vocabulary import Sampling

MODEL_VERSION = "1"
"""cadence serves one version of its model; requests may name it or leave the version empty."""

PLATFORM = "cadence"

EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"
"""Request parameter: also send a response without outputs when the final flag comes alone."""
PRIORITY_PARAMETER = "priority"
"""Request parameter: the scheduling priority, an integer (int64 or uint64), lower served
first as Triton's and vLLM's (default 0)."""
CACHED_TOKENS_PARAMETER = "cached_tokens"
"""The final response's parameter (int64): prompt tokens the prefix cache served."""


class TensorSpec(NamedTuple):
    name: str
    datatype: str
    """The protocol's name: INT32, FP32, BYTES, ..."""
    shape: tuple[int, ...]
    """-1: any length."""
    optional: bool = True


INPUTS = (
    TensorSpec("PROMPT", "BYTES", (1,)),
    TensorSpec("PROMPT_TOKEN_IDS", "INT32", (-1,)),
    TensorSpec("MAX_TOKENS", "INT32", (1,), optional=False),
    TensorSpec("TEMPERATURE", "FP32", (1,)),
    TensorSpec("TOP_P", "FP32", (1,)),
    TensorSpec("TOP_K", "INT32", (1,)),
    TensorSpec("SEED", "UINT64", (1,)),
    TensorSpec("STOP_TOKEN_IDS", "INT32", (-1,)),
)
OUTPUTS = (
    TensorSpec("TOKEN_IDS", "INT32", (-1,)),
    TensorSpec("TEXT", "BYTES", (1,)),
)
_INPUTS = {spec.name: spec for spec in INPUTS}
_OUTPUT_NAMES = frozenset(spec.name for spec in OUTPUTS)
_CONFIG_TYPES = {
    "BYTES": mpb.TYPE_STRING,
    "INT32": mpb.TYPE_INT32,
    "FP32": mpb.TYPE_FP32,
    "UINT64": mpb.TYPE_UINT64,
}
_UINT32_MAX, _UINT64_MAX, _INT32 = 2**32 - 1, 2**64 - 1, (-(2**31), 2**31 - 1)


class StreamRequest(NamedTuple):
    """One ModelStreamInfer request, translated."""

    request: Request
    """The core's request (validated further there)."""
    want_tokens: bool
    want_text: bool
    empty_final: bool
    """The client asked for an empty final response (`triton_enable_empty_final_response`)."""


def metadata(name: str) -> kpb.ModelMetadataResponse:
    """The model's ModelMetadata answer."""
    response = kpb.ModelMetadataResponse(name=name, versions=[MODEL_VERSION], platform=PLATFORM)
    for specs, tensors in ((INPUTS, response.inputs), (OUTPUTS, response.outputs)):
        for spec in specs:
            tensors.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
    return response


def config(name: str) -> mpb.ModelConfig:
    """The model's ModelConfig: no batching (shapes are whole), decoupled."""
    result = mpb.ModelConfig(name=name, platform=PLATFORM, backend=PLATFORM, max_batch_size=0)
    for spec in INPUTS:
        result.input.add(
            name=spec.name,
            data_type=_CONFIG_TYPES[spec.datatype],
            dims=spec.shape,
            optional=spec.optional,
        )
    for spec in OUTPUTS:
        result.output.add(name=spec.name, data_type=_CONFIG_TYPES[spec.datatype], dims=spec.shape)
    result.model_transaction_policy.decoupled = True
    return result


def to_stream_request(request: kpb.ModelInferRequest) -> StreamRequest:
    """Read the request's tensors into the core's request; raise InvalidRequest."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents has {len(raw)} entries for "
            f"{len(request.inputs)} inputs; give one per input, or none"
        )
    values: dict[str, list] = {}
    for i, tensor in enumerate(request.inputs):
        spec = _INPUTS.get(tensor.name)
        if spec is None:
            raise InvalidRequest(
                f"unknown input {tensor.name!r}; the model takes {', '.join(_INPUTS)}"
            )
        if tensor.name in values:
            raise InvalidRequest(f"input {tensor.name!r} is given twice")
        _check_datatype(spec, tensor.datatype)
        try:
            data = decode_input(tensor, raw[i] if raw else None)
        except TensorError as exc:
            raise InvalidRequest(str(exc)) from None
        if spec.shape == (1,) and len(data) != 1:
            raise InvalidRequest(f"input {spec.name!r} takes one element, got {len(data)}")
        values[spec.name] = data
    if "MAX_TOKENS" not in values:
        raise InvalidRequest("input 'MAX_TOKENS' is missing: how many tokens to generate at most")
    generate = Request(
        request_id=request.id,
        max_tokens=_integer(values, "MAX_TOKENS", 1, _UINT32_MAX),
        prompt_token_ids=_integers(values, "PROMPT_TOKEN_IDS"),
        sampling=Sampling(
            stop_token_ids=tuple(_integers(values, "STOP_TOKEN_IDS")),
            top_k=_integer(values, "TOP_K", 0, _UINT32_MAX),
            seed=_integer(values, "SEED", 0, _UINT64_MAX),
            temperature=_float(values, "TEMPERATURE"),
            top_p=_float(values, "TOP_P"),
        ),
    )
    if "PROMPT" in values:
        try:
            generate.prompt = values["PROMPT"][0].decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("input 'PROMPT' is not UTF-8 text") from None
    wanted = {output.name for output in request.outputs}
    unknown = wanted - _OUTPUT_NAMES
    if unknown:
        raise InvalidRequest(
            f"unknown output {min(unknown)!r}; the model has "
            f"{', '.join(spec.name for spec in OUTPUTS)}"
        )
    empty_final = request.parameters.get(EMPTY_FINAL_PARAMETER)
    generate.priority = _priority(request.parameters.get(PRIORITY_PARAMETER))
    return StreamRequest(
        generate,
        want_tokens=not wanted or "TOKEN_IDS" in wanted,
        want_text=not wanted or "TEXT" in wanted,
        empty_final=empty_final is not None and empty_final.bool_param,
    )


def _priority(parameter: kpb.InferParameter | None) -> int:
    if parameter is None:
        return 0
    kind = parameter.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidRequest(
            f"parameter {PRIORITY_PARAMETER!r} must be an integer "
            "(int64_param or uint64_param); lower is served first"
        )
    return getattr(parameter, kind)


def _check_datatype(spec: TensorSpec, datatype: str) -> None:
    if spec.datatype == "BYTES":
        ok = datatype == "BYTES"
    elif spec.datatype == "FP32":
        ok = datatype in FLOAT_TYPES
    else:
        ok = datatype in INTEGER_TYPES
    if not ok:
        raise InvalidRequest(
            f"input {spec.name!r} has datatype {datatype!r}; expected {spec.datatype}"
        )


def _integer(values: dict[str, list], name: str, lo: int, hi: int) -> int:
    if name not in values:
        return 0
    value = values[name][0]
    if not lo <= value <= hi:
        raise InvalidRequest(f"input {name!r} is {value}; it must be between {lo} and {hi}")
    return value


def _float(values: dict[str, list], name: str) -> float:
    return float(values[name][0]) if name in values else 0.0


def _integers(values: dict[str, list], name: str) -> list[int]:
    data = values.get(name, [])
    if data and not (_INT32[0] <= min(data) and max(data) <= _INT32[1]):
        raise InvalidRequest(f"input {name!r} holds a value outside INT32")
    return data
