"""RewardModelWorker: a scalar-head GPTModel that scores whole sequences (forward only).

The score is read at each row's last valid token and placed at that token's slot in a
token-level (B, R) tensor, zeros elsewhere: `rm_scores`. The model is loaded from an HF
directory; its `score.weight` (an HF *ForSequenceClassification checkpoint) becomes the head.
The RM reads the policy's token ids as they are (same tokenizer as the actor).
"""

from __future__ import annotations

from hybridflow.config.schema import RewardModelConfig
from hybridflow.controller import Dispatch, Worker, register
from hybridflow.protocol import DataProto
from megatron_workers.engine import as_config, build_role_engine, init_megatron, mesh_coords, unpack_tokens
from megatron_workers.heads import last_token_scores
from megatron_workers.offload import Offloader

MESH = "reward"


class RewardModelWorker(Worker):
    def __init__(self, config):
        super().__init__()
        self.config: RewardModelConfig = as_config(config, RewardModelConfig)
        self.engine = None
        self.offload = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.config
        dims = init_megatron(cfg.megatron)
        self.engine = build_role_engine(cfg.model.path, dims, cfg.model.dtype, megatron_cfg=cfg.megatron,
                                        scalar_head=True)
        self.offload = Offloader(self.engine, params=cfg.megatron.param_offload, grads=False, optimizer=False)
        self.set_mesh_coords(MESH, **mesh_coords())
        self.offload.offload()

    @register(dispatch=Dispatch.DP_COMPUTE_PROTO, mesh=MESH)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        response_length = data.batch["responses"].shape[1]

        def post(output, micro):
            scores = unpack_tokens(output[..., 0], micro)
            return {"rm_scores": last_token_scores(scores, micro["attention_mask"], response_length).float()}

        batch = {k: data.batch[k] for k in ("input_ids", "attention_mask")}
        cfg = self.config
        budget = cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None
        with self.offload.resident():
            out = self.engine.forward_only(batch, cfg.micro_batch_size_per_gpu, post, max_tokens=budget)
        return DataProto.from_dict({"rm_scores": out["rm_scores"]},
                                   meta_info={"perf/padding_fraction/rm": self.engine.padding_fraction})
