"""What runs inside each of vLLM's worker processes: loading weights and receiving a publish.

vLLM mixes `WeightLoadingExtension` into its worker class (`worker_extension_cls`), one worker
per tensor-parallel (and pipeline) rank, and the backend calls these methods on every worker at
once through `LLM.collective_rpc`. Arguments and results are control messages (see
`vllm_transfer`); the weights come from a shared-memory file or from the learner's process
group.

Loading follows vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`): one
layerwise-reload session per version (`initialize_layerwise_reload` ... the model's
`load_weights` per bucket ... `finalize_layerwise_reload`), so the model's post-load processing
(fused and repacked kernels, quantisation) runs once a layer has all its tensors, and a layer's
tensors may arrive in different buckets. Every worker receives the full tensors of a bucket and
the model's `load_weights` keeps its own tensor-parallel shard of each.

Nothing here runs while the engine is stepping: the backend pauses scheduling around a load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from services.generation.vllm_transfer import (
    group_from_wire,
    manifest_from_wire,
    open_shared_bucket,
)
from services.weights.base import WeightsManifest
from services.weights.loading import with_aliases

if TYPE_CHECKING:
    from services.weights.base import Channel

# How `kpo_receive_weights` treats what it receives.
RECEIVE_MODES = ("apply", "stage", "drain")


class WeightLoadingExtension:
    """Methods vLLM adds to its worker class; `self` is the vLLM worker.

    Names start with `kpo_` (vLLM refuses an extension whose names clash with the worker's).
    """

    if TYPE_CHECKING:  # set by vLLM's worker; annotations only, so nothing clashes
        rank: int
        vllm_config: Any
        model_config: Any
        model_runner: Any

    # --- one version, bucket by bucket -----------------------------------------------------------

    def kpo_begin_weight_update(self) -> None:
        """Open a layerwise-reload session on the live model."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            initialize_layerwise_reload,
        )

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def kpo_load_shared_bucket(self, bucket: dict[str, Any], aliases: dict[str, str]) -> int:
        """Load the bucket in the shared file `bucket` describes; return its tensor count."""
        tensors = open_shared_bucket(bucket)
        try:
            self._kpo_load(tensors, aliases)
            return len(tensors)
        finally:
            del tensors  # unmap the file: the backend removes it once every worker returned

    def kpo_finish_weight_update(self) -> None:
        """Close the session: process what is left, restore any layer that got no tensor."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        # What `Worker.reload_weights` resets after an in-place reload (state derived from the
        # old weights); no-ops for a text model without LoRA.
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()

    def _kpo_load(self, bucket: Mapping[str, Tensor], aliases: Mapping[str, str]) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights(with_aliases(bucket, aliases).items())

    def _kpo_load_version(
        self, manifest: WeightsManifest, buckets: Iterable[Mapping[str, Tensor]]
    ) -> int:
        """One session over every bucket of `manifest`; return the tensor count."""
        count = 0
        self.kpo_begin_weight_update()
        try:
            for bucket in buckets:
                self._kpo_load(bucket, manifest.aliases)
                count += len(bucket)
        finally:
            # Closed even after a failure: a layer left mid-session holds meta tensors.
            self.kpo_finish_weight_update()
        return count

    # --- the collective transport ----------------------------------------------------------------

    def kpo_join_weight_group(self, group: dict[str, Any], first_rank: int, host: str) -> int:
        """Join the learner's weight group as rank `first_rank` + this worker's rank (blocks
        until every rank joined); return that rank. Leaves any group joined before."""
        from services.weights.collective import connect

        self.kpo_leave_weight_group()
        rank = int(first_rank) + int(self.rank)
        self._kpo_channel: Channel | None = connect(group_from_wire(group), rank, host=host)
        return rank

    def kpo_leave_weight_group(self) -> None:
        channel: Channel | None = getattr(self, "_kpo_channel", None)
        self._kpo_channel = None
        if channel is not None:
            channel.close()

    def kpo_receive_weights(self, manifest: dict[str, Any], mode: str) -> int:
        """Receive every bucket of a publish from the group; return the tensors received.

        mode "apply": load them into the live model as they arrive. "stage": keep CPU copies
        for `kpo_apply_staged` (the model is not touched). "drain": receive and drop (the
        backend found the manifest does not fit the model; the sender must not be left
        waiting).
        """
        if mode not in RECEIVE_MODES:
            raise ValueError(f"receive mode must be one of {RECEIVE_MODES}, got {mode!r}")
        channel: Channel | None = getattr(self, "_kpo_channel", None)
        if channel is None:
            raise RuntimeError("receive_weights before join_weight_group: no weight group joined")
        received = manifest_from_wire(manifest)
        buckets = channel.receive(
            received
        )  # where the group puts them: CPU (gloo), GPU (NCCL, ipc)
        if mode == "drain":
            return sum(len(bucket) for bucket in buckets)
        if mode == "stage":
            staged = [{n: t.to("cpu", copy=True) for n, t in b.items()} for b in buckets]
            self._kpo_staged: tuple[WeightsManifest, list[dict[str, Tensor]]] | None = (
                received,
                staged,
            )
            return sum(len(bucket) for bucket in staged)
        self._kpo_staged = None  # older than what is loaded now
        try:
            return self._kpo_load_version(received, buckets)
        except BaseException:
            _drain(buckets)
            raise

    def kpo_apply_staged(self, version: int) -> int:
        """Load the buckets `kpo_receive_weights(mode="stage")` kept; return the tensor count."""
        staged = getattr(self, "_kpo_staged", None)
        if staged is None or staged[0].version != version:
            held = None if staged is None else staged[0].version
            raise RuntimeError(f"no staged weights of version {version} (staged: {held})")
        manifest, buckets = staged
        self._kpo_staged = None
        return self._kpo_load_version(manifest, buckets)


def _drain(buckets: Iterator[Mapping[str, Tensor]]) -> None:
    """Take the rest of a broadcast so that the sender and the other receivers finish; a
    failure there (the group itself broke) is secondary to the one being raised."""
    with contextlib.suppress(Exception):
        for _ in buckets:
            pass
