"""Triton Python-backend model `tokenswift`: decoupled, streams text as TokenSwift accepts it.

Request parsing and generation live in `tokenswift_trt.serving.handler`; this file only maps
Triton tensors, responses, errors, cancellation and metrics onto it.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from tokenswift_trt.serving.handler import REQUEST_SETTINGS, Cancelled, RequestError, Session

INPUTS = ("text_input", "max_tokens", "stream", "request_id", "resume", *REQUEST_SETTINGS)


def _inputs(request) -> dict:
    found = {}
    for name in INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            found[name] = tensor.as_numpy()
    return found


def _text(text: str):
    return pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))


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
        )
        # the families must outlive their metrics, so both are kept
        self.tokens_family = pb_utils.MetricFamily(
            name="tokenswift_generated_tokens_total",
            description="Tokens generated",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.tokens_metric = self.tokens_family.Metric(labels={"model": "tokenswift"})
        self.acceptance_family = pb_utils.MetricFamily(
            name="tokenswift_acceptance_rate",
            description="Draft acceptance rate of the last request",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.acceptance_metric = self.acceptance_family.Metric(labels={"model": "tokenswift"})
        self.requests_metric = pb_utils.MetricFamily(
            name="tokenswift_requests_total",
            description="Requests by outcome",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self.outcomes = {
            name: self.requests_metric.Metric(labels={"model": "tokenswift", "outcome": name})
            for name in ("ok", "error", "cancelled")
        }

    def execute(self, requests):
        for request in requests:
            self._serve(request)
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            parsed = self.session.parse(_inputs(request))
            stream = parsed.stream

            def on_text(piece: str) -> None:
                if stream:
                    sender.send(pb_utils.InferenceResponse(output_tensors=[_text(piece)]))

            text, stats = self.session.run(parsed, on_text, cancelled=request.is_cancelled)
        except RequestError as error:
            self.outcomes["error"].increment(1)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=final)
            return
        except Cancelled:
            self.outcomes["cancelled"].increment(1)
            sender.send(flags=final)
            return
        except Exception as error:  # keep serving: report the failure to this client only
            self.outcomes["error"].increment(1)
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(f"generation failed: {error}")),
                flags=final,
            )
            return
        outputs = [
            _text("" if stream else text),
            pb_utils.Tensor("acceptance_rate", np.array([stats.acceptance_rate], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([stats.accepted_tokens], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([stats.drafted_tokens], dtype=np.int32)),
            pb_utils.Tensor("tokens_per_second", np.array([stats.tokens_per_s], dtype=np.float32)),
        ]
        self.tokens_metric.increment(stats.new_tokens)
        self.acceptance_metric.set(stats.acceptance_rate)
        self.outcomes["ok"].increment(1)
        sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=final)
