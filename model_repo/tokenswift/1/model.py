"""Triton Python-backend model `tokenswift`: decoupled, streams text as TokenSwift accepts it.

Request parsing and generation live in `tokenswift_trt.serving.handler`, the metrics in
`tokenswift_trt.serving.metrics`; this file only maps Triton tensors, parameters, responses, errors,
cancellation and metrics onto them.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from tokenswift_trt.serving.errors import INVALID, fault_of
from tokenswift_trt.serving.handler import (
    DEFAULT_MAX_QUEUE,
    REQUEST_SETTINGS,
    Cancelled,
    RequestError,
    Session,
)
from tokenswift_trt.serving.metrics import ServingMetrics

INPUTS = ("text_input", "max_tokens", "stream", "request_id", "resume", *REQUEST_SETTINGS)


def _inputs(request) -> dict:
    """The request's input tensors; a request parameter (e.g. an unknown key of an HTTP generate
    body, which Triton passes on as a parameter) is refused, so a misspelt setting is never ignored."""
    found = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    unknown = sorted(key for key in json.loads(request.parameters() or "{}") if not key.startswith("triton_"))
    if unknown:
        raise RequestError(
            f"unknown request field(s) {', '.join(unknown)}: the fields are {', '.join(INPUTS)}"
        )
    return found


def _text(text: str):
    return pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))


def _error(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        budget = parameters.get("memory_budget_gib")
        self.session = Session(
            parameters["engine_dir"],
            device=parameters.get("device", "cpu"),
            journal_dir=parameters.get("journal_dir") or None,
            memory_budget=int(float(budget) * (1 << 30)) if budget else None,
            kernels=parameters.get("kernels", ""),
            tp=int(parameters.get("tp") or 1),
            tp_timeout=float(parameters.get("tp_timeout") or 120.0),
            python=parameters.get("python", ""),
            max_batch=int(parameters.get("max_batch") or 0),
            max_queue=int(parameters.get("max_queue") or DEFAULT_MAX_QUEUE),
        )
        self.metrics = ServingMetrics(pb_utils.MetricFamily)
        if self.session.batch is not None:
            self.session.batch.on_step = lambda scheduler: self.metrics.batch(
                len(scheduler.active),
                len(scheduler.queue),
                sum(1 for waiting in scheduler.queue if waiting.waiting_reason),
                scheduler.planner.hold,
            )
        self.eos = set(self.session.engine.config.eos_token_ids)

    def finalize(self):
        self.session.close()  # requests still in the batch end with an error response
        if self.session.ranks is not None:
            self.session.ranks.stop()  # the tensor-parallel worker ranks end with the instance

    def execute(self, requests):
        failed = [message for request in requests if (message := self._serve(request))]
        if failed:
            # Every request already has its own error response; raising tells Triton that the requests
            # of this call failed, so that they count in nv_inference_request_failure (a decoupled
            # model's responses alone do not).
            raise pb_utils.TritonModelException("; ".join(failed))
        return None

    def _serve(self, request) -> str | None:
        """Answer one request: batched (continuous batching: answered from the scheduler's thread as
        its tokens commit) or alone. The error message when it failed here and now."""
        sender = request.get_response_sender()
        meter = self.metrics.meter()
        generated: list[int] = []
        try:
            parsed = self.session.parse(_inputs(request))
        except Exception as error:  # the client's mistake, or its request id running elsewhere
            return self._answer(sender, meter, None, generated, "", None, error)
        meter.prompt(len(parsed.prompt_ids))

        def on_ids(ids: list[int]) -> None:
            generated.extend(ids)
            meter.generated(len(ids))

        def on_text(piece: str) -> None:
            if parsed.stream:
                sender.send(pb_utils.InferenceResponse(output_tensors=[_text(piece)]))

        def on_done(text: str, stats, failure) -> str | None:
            return self._answer(sender, meter, parsed, generated, text, stats, failure)

        try:
            if self.session.batch is not None:
                self.session.start(parsed, on_text, request.is_cancelled, on_done, on_ids)
                return None
            text, stats = self.session.run(parsed, on_text, cancelled=request.is_cancelled, on_ids=on_ids)
        except Exception as error:  # keep serving: report the failure to this client only
            parsed.release()
            return on_done("", None, error)
        return on_done(text, stats, None)

    def _answer(self, sender, meter, parsed, generated: list[int], text: str, stats, failure) -> str | None:
        """A request's last response, by how it ended: cancelled (no error), the client's mistake
        (gRPC INVALID_ARGUMENT, HTTP 400), a server fault (errors.py: UNAVAILABLE for what may pass,
        "server busy" or "server shutting down"; INTERNAL for a failure inside generation), or its
        result. The error message when it failed."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if isinstance(failure, Cancelled):
            meter.end("cancelled")
            sender.send(flags=final)
            return None
        if isinstance(failure, RequestError):
            meter.end("error", INVALID)
            sender.send(_error(str(failure), pb_utils.TritonError.INVALID_ARG), flags=final)
            return str(failure)
        if failure is not None:
            fault = fault_of(failure)
            meter.end("error", fault.cause.reason)
            code = (
                pb_utils.TritonError.UNAVAILABLE
                if fault.cause.status == 503
                else pb_utils.TritonError.INTERNAL
            )
            sender.send(_error(str(fault), code), flags=final)
            return str(fault)
        meter.drafts(stats)
        meter.end("ok")
        sender.send(self._final(parsed, generated, stats, text), flags=final)
        return None

    def _final(self, parsed, generated: list[int], stats, text: str):
        """The last response of a request: the text unless it streamed, its figures and finish reason."""
        all_ids = parsed.done_ids + generated
        finish = "stop" if all_ids and all_ids[-1] in self.eos and not parsed.config.ignore_eos else "length"
        outputs = [
            _text("" if parsed.stream else text),
            pb_utils.Tensor("acceptance_rate", np.array([stats.acceptance_rate], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([stats.accepted_tokens], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([stats.drafted_tokens], dtype=np.int32)),
            pb_utils.Tensor("tokens_per_second", np.array([stats.tokens_per_s], dtype=np.float32)),
            pb_utils.Tensor("draft_updates", np.array([stats.draft_updates], dtype=np.int32)),
            pb_utils.Tensor("prompt_tokens", np.array([len(parsed.prompt_ids)], dtype=np.int32)),
            pb_utils.Tensor("completion_tokens", np.array([len(all_ids)], dtype=np.int32)),
            pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)),
        ]
        return pb_utils.InferenceResponse(output_tensors=outputs)
