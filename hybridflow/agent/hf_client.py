"""An LLMClient over a Hugging Face causal LM in this process: agent loops without a rollout server.

For tests, debugging and notebooks: the same token-in/token-out contract as the server
(hybridflow/rollout/server_api.py), one request at a time. Sampling is a plain loop over the model's
logits: temperature, top-k, top-p (greedy: argmax), drawn from a torch.Generator seeded with the request's
seed, so a (seed, prompt) pair samples the same tokens every time. The log-prob of a token is the one under
the distribution sampled from (after temperature and filtering), as hybridflow/rollout/base.py defines it.
`logits_hook(prompt_ids, generated_ids, logits) -> logits` may reshape the distribution (tests use it to steer
a random model into a tool call); what it returns is what is sampled from and scored.
"""

from __future__ import annotations

from hybridflow.rollout.server_api import TokenOutput, TurnSampling


class HFTokenClient:
    def __init__(self, model, eos_token_id: int | None = None, weight_version: int = 0, logits_hook=None):
        import torch

        self.model = model.eval()
        self.eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.weight_version, self.logits_hook = weight_version, logits_hook
        self.requests: list[tuple[list[int], TurnSampling, str]] = []  # what was asked, for inspection
        self._torch = torch

    async def generate(self, prompt_ids: list[int], sampling: TurnSampling, route_key: str) -> TokenOutput:
        torch = self._torch
        self.requests.append((list(prompt_ids), sampling, route_key))
        gen = torch.Generator().manual_seed(0 if sampling.seed is None else int(sampling.seed))
        stops = {*sampling.stop_token_ids, *([self.eos] if isinstance(self.eos, int) else self.eos or [])}
        ids, log_probs, past = list(prompt_ids), [], None
        out_ids: list[int] = []
        finish = "length"
        with torch.no_grad():
            step_input = torch.tensor([ids])
            for _ in range(sampling.max_tokens):
                res = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1].float()
                if self.logits_hook is not None:
                    logits = self.logits_hook(list(prompt_ids), list(out_ids), logits)
                if sampling.greedy or sampling.temperature == 0:
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = int(torch.argmax(logp))
                else:
                    logp = torch.log_softmax(_filter(logits / sampling.temperature, sampling.top_k, sampling.top_p),
                                             dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                out_ids.append(tok)
                log_probs.append(float(logp[tok]))
                if tok in stops:
                    finish = "stop"
                    break
                step_input = torch.tensor([[tok]])
        return TokenOutput(out_ids, log_probs, finish, self.weight_version)


def _filter(logits, top_k: int, top_p: float):
    import torch

    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits
