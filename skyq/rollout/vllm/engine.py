"""`VllmEngine`: a vLLM engine driven the way skyq drives its embedded engine.

Generate with log-probs, take part in a weight sync (receive -> verify -> commit, over skyq's
accounted transport), report the committed weight version, shut down. One engine per process: vLLM's
engine core runs in this process or, with `rollout.engine_core_process`, in a child of it
(`engine_args.engine_env`); either way the Ray actor wrapping it owns it and `shutdown` frees it.
Everything skyq asks the worker goes through `collective_rpc` by method name with plain-data arguments
and results, which vLLM's msgpack transport carries between processes without pickle (results come
back with lists where tuples were). The environment (`engine_env`) must be applied before vLLM is
imported in the process (`engine_args.apply_env`), i.e. before this module is.
"""

from __future__ import annotations

import time
from typing import Any

from vllm import LLM, SamplingParams

from skyq.config.schema import ModelConfig, PrecisionConfig
from skyq.quant.plan import build_plan
from skyq.rl.batch import FinishReason, Sample
from skyq.rl.tokenizer import EOS_ID
from skyq.rollout.vllm.compat import DUMMY_LOAD_FORMAT, check_version, request_amx_tiles
from skyq.sync.errors import SyncError
from skyq.sync.plan_wire import WireDigest, expected_units
from skyq.sync.wire_dtypes import dtype_name

NO_WEIGHTS = -1
"""The version of an engine booted with dummy weights: it refuses to generate until a sync."""


class VllmEngine:
    """One vLLM engine (`vllm.LLM`) with skyq's weight-transfer backend and worker extension."""

    def __init__(
        self,
        *,
        llm_kwargs: dict[str, Any],
        model_cfg: ModelConfig,
        precision_cfg: PrecisionConfig,
        eos_token_id: int = EOS_ID,
    ) -> None:
        check_version()
        request_amx_tiles()  # where the engine core computes in this process (its child asks on its own)
        start = time.perf_counter()
        self.llm = LLM(**llm_kwargs)
        self.build_s = time.perf_counter() - start
        """Seconds the engine took to boot."""
        self.eos_token_id = eos_token_id
        self.expected = expected_units(build_plan(model_cfg, precision_cfg))
        self._booted_version = NO_WEIGHTS if llm_kwargs.get("load_format") == DUMMY_LOAD_FORMAT else 0
        self._closed = False

    # generation ---------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
    ) -> list[Sample]:
        """`n` samples per prompt, grouped: result[i * n + j] is sample j of prompt i, each with the
        log-prob of every sampled token (temperature 0 is greedy)."""
        self._check_usable()
        if self.weight_version() == NO_WEIGHTS:
            raise SyncError("generate before the first sync: the engine booted with dummy weights")
        params = SamplingParams(
            n=n,
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=[self.eos_token_id],
            detokenize=False,
        )
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        samples = []
        for prompt, out in zip(prompts, outputs, strict=True):
            for completion in out.outputs:
                ids = list(completion.token_ids)
                logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs)]
                stopped = completion.finish_reason == "stop"
                samples.append(
                    Sample(
                        prompt_ids=list(prompt),
                        response_ids=ids,
                        logprobs=logprobs,
                        finish_reason=FinishReason.stop if stopped else FinishReason.length,
                    )
                )
        return samples

    # weight sync --------------------------------------------------------------------------------

    def join_sync_group(self, port: int, timeout_s: float, *, verify_checksum: bool = True) -> None:
        """Join the trainer's weight-sync group (its store on loopback `port`) as the receiver."""
        expected = [
            (u.source, {name: (list(shape), dtype_name(dtype)) for name, (shape, dtype) in u.tensors.items()})
            for u in self.expected
        ]
        init_info = {
            "port": port,
            "timeout_s": timeout_s,
            "expected": expected,
            "verify_checksum": verify_checksum,
        }
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self._rpc("skyq_weight_version")  # the worker took skyq's backend
        if self._booted_version == NO_WEIGHTS:
            self.llm.collective_rpc("skyq_set_booted_version", args=(NO_WEIGHTS,))

    def receive_weights(self) -> dict[str, float]:
        """Take part in one sync; the weights and version change only if it fully succeeds. The
        prefix cache is reset after it, so no prompt is answered from KV of the old weights."""
        self._check_open()
        self.llm.start_weight_update()
        try:
            self.llm.update_weights({"update_info": {}})
        finally:
            # Whatever happened, the reset cannot hurt and a mixed or new state needs it.
            self.llm.reset_prefix_cache()
        self.llm.finish_weight_update()
        stats = self._rpc("skyq_last_sync")
        return {"version": stats["version"], "recv_s": stats["recv_s"], "load_s": stats["load_s"]}

    def weight_version(self) -> int:
        return self._rpc("skyq_weight_version")

    def weight_checksums(self) -> dict[str, str]:
        """sha256 of every vLLM parameter and buffer, for comparisons (the worker extension's: vLLM
        0.26 has no `compute_weight_checksums`)."""
        return self._rpc("skyq_weight_checksums")

    def first_wire_digest(self) -> WireDigest | None:
        """Digest of the wire state of the first sync this engine committed (None before one), with
        the tuples a child engine core's msgpack reply turns into lists restored."""
        digest = self._rpc("skyq_first_wire_digest")
        if digest is None:
            return None
        return {name: (dtype, tuple(shape), sha) for name, (dtype, shape, sha) in digest.items()}

    def build_seconds(self) -> float:
        return self.build_s

    # lifecycle ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the sync channel, stop the engine core and free its memory; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            # The worker extension's: vLLM 0.26's LLM has no shutdown_weight_transfer_engine.
            self.llm.collective_rpc("skyq_shutdown_transfer")
        finally:
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    def _rpc(self, method: str) -> Any:
        self._check_open()
        return self.llm.collective_rpc(method)[0]

    def _check_open(self) -> None:
        if self._closed:
            raise SyncError("the vLLM engine was shut down")

    def _check_usable(self) -> None:
        why = self._rpc("skyq_unusable")
        if why is not None:
            raise SyncError(f"the engine's weights are not one version ({why}); sync again before generating")
