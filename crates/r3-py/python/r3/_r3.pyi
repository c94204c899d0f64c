"""Type stubs of the compiled core ``r3._r3`` (PyO3 over r3-routing)."""

import os
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

class RouteError(ValueError):
    """Invalid routes, payload or argument; the message names the token, layer and value.
    A negative (or too large) integer argument raises it too, naming the argument."""

class LayerLayout:
    """Which layers are MoE layers, the routed-expert count and top-k of a model."""

    def __init__(
        self, num_hidden_layers: int, moe_layers: Sequence[int], *, num_experts: int, top_k: int
    ) -> None: ...
    @staticmethod
    def from_hf_config(path_or_dict: Union[str, "os.PathLike[str]", Dict[str, Any]]) -> "LayerLayout": ...
    @property
    def moe_layers(self) -> List[int]: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_moe_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    def is_moe(self, layer: int) -> bool: ...

class RouteTable:
    """Validated logical expert ids ``[rows, moe_layers, top_k]`` of one sequence."""

    @staticmethod
    def from_sglang(
        payload: Union[str, bytes, Dict[str, Any]],
        *,
        layout: LayerLayout,
        dtype: Optional[str] = None,
        start_len: int = 0,
    ) -> "RouteTable":
        """SGLang's ``routed_experts``: base64 text in ``dtype`` (int32 when None), or the
        response / ``meta_info`` dict, whose ``routed_experts_dtype`` an explicit ``dtype``
        overrides."""
    @staticmethod
    def from_vllm(
        array_or_bytes: Union[npt.ArrayLike, bytes, str, Dict[str, Any], List[Any]],
        *,
        layout: LayerLayout,
        start_len: int = 0,
        choice: Optional[int] = None,
    ) -> "RouteTable":
        """vLLM's ``routed_experts``; a response of several choices needs ``choice`` (one
        choice's routes each), never read as choice 0."""
    @staticmethod
    def from_numpy(ids: npt.ArrayLike, *, layout: LayerLayout, start_pos: int = 0) -> "RouteTable": ...
    @staticmethod
    def from_json(text: str, *, layout: LayerLayout) -> "RouteTable": ...
    def to_json(self) -> str: ...
    @property
    def ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def present(self) -> npt.NDArray[np.bool_]: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def end_pos(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def layers(self) -> List[int]: ...
    @property
    def layout(self) -> LayerLayout: ...
    def slice_rows(self, start: int, stop: int) -> "RouteTable": ...
    def to_sglang(self, dtype: str = "int32") -> str: ...
    def to_vllm(self, dtype: str = "int16", npy_version: int = 1) -> str: ...
    def to_numpy_all_layers(self) -> npt.NDArray[np.int32]: ...
    def __len__(self) -> int: ...

class PipelineSplit:
    """Megatron's split of the transformer layers over pipeline (and virtual) stages."""

    def __init__(
        self,
        num_layers: int,
        pp_size: int = 1,
        *,
        vp_size: Optional[int] = None,
        first_stage_layers: Optional[int] = None,
        last_stage_layers: Optional[int] = None,
        account_for_embedding: bool = False,
        account_for_loss: bool = False,
        pipeline_layout: Union[str, Sequence[Sequence[Any]], Any, None] = None,
    ) -> None:
        """``pipeline_layout``: Megatron's ``pipeline_model_parallel_layout`` — its string
        form (``"Et|tt|tt|tL"``, ``"E|(t*4|)*3,tt,m,L"``), its list form (stages of
        ``LayerType`` names or members in Megatron's flat order) or a
        ``PipelineParallelLayerLayout``; it then decides the split alone (the virtual stages
        are its stages over ``pp_size``)."""
    @property
    def pipeline_layout(self) -> Optional[List[List[str]]]:
        """The custom layout's stages (``LayerType`` names), stage ``vp_stage * pp_size +
        pp_rank`` first to last; None without one."""
    def layer_offset(self, pp_rank: int, vp_stage: Optional[int] = None) -> int: ...
    def num_layers_to_build(self, pp_rank: int, vp_stage: Optional[int] = None) -> int: ...
    def local_layers(self, pp_rank: int, vp_stage: Optional[int] = None) -> List[int]: ...

def merge_resumed(
    pieces: Sequence[RouteTable],
    policy: Literal[
        "keep_per_token_origin", "replace_with_resumed", "prefer_resumed_from_its_start"
    ] = "keep_per_token_origin",
) -> RouteTable:
    """Folds the tables of one request's calls (in call order): ``keep_per_token_origin``
    (each row from the call that fed it), ``replace_with_resumed`` (the resumed call's table
    whole) or ``prefer_resumed_from_its_start`` (slime's merge: the earlier rows before the
    resumed call's start, the resumed call's rows from there on)."""
def check_covers_sequence(table: RouteTable, total_tokens: int) -> None: ...
def mismatch(
    train_logp: npt.ArrayLike, rollout_logp: npt.ArrayLike, mask: Optional[npt.ArrayLike] = None
) -> Dict[str, Optional[float]]:
    """Mismatch metrics from float32 log-probs; other dtypes only when every value is exactly
    a float32 (else ``RouteError`` naming the value)."""
def routing_divergence(a: RouteTable, b: RouteTable) -> Dict[str, Any]: ...
# The token layouts: "thd" (packed, zigzag context parallelism per sequence), "bshd"
# (padded batch, position-major), "thd_contiguous_cp" (packed, the whole stream cut into cp
# contiguous parts: slime's --allgather-cp).
_Packing = Literal["thd", "bshd", "thd_contiguous_cp"]

def rank_tokens(
    seq_lens: Sequence[int],
    packing: _Packing = "thd",
    sp: Tuple[int, int] = (1, 0),
    cp: Tuple[int, int] = (1, 0),
    *,
    cu_seqlens_padded: Optional[Sequence[int]] = None,
    padded_len: Optional[int] = None,
    trailing_padding: bool = False,
) -> npt.NDArray[np.int64]: ...
def replay_ids(
    tables: Sequence[RouteTable],
    router_layers: Sequence[int],
    packing: _Packing = "thd",
    sp: Tuple[int, int] = (1, 0),
    cp: Tuple[int, int] = (1, 0),
    *,
    cu_seqlens_padded: Optional[Sequence[int]] = None,
    padded_len: Optional[int] = None,
    trailing_padding: bool = False,
    seq_lens: Optional[Sequence[int]] = None,
    num_tokens: Optional[int] = None,
) -> npt.NDArray[np.int64]: ...
