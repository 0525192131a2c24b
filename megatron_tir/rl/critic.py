"""Critic maths for PPO in tool-integrated reasoning: token rewards (outcome + KL in the reward),
GAE over the model's own tokens only, the clipped value loss and explained variance.

Masking (ZeroTIR, arXiv 2505.07773, "value-function masking"): the critic is trained on the
tokens the policy wrote, never on the interpreter's output. Here ``mask_BT`` is the model-token
mask (``loss_mask_BT`` of the rollout batch: 1 on sampled tokens, 0 on prompt, feedback and
padding). Two ways to cross a feedback span (``across_feedback``):

* ``carry`` (default) -- GAE runs right to left over the model tokens of each row and **skips**
  every other token: the next value and the running advantage are carried across a feedback span
  unchanged, as verl's ``core_algos.compute_gae_advantage_return`` does for multi-turn
  observations. The feedback tokens are not steps of the MDP: with ``gamma = lam = 1`` and an
  outcome reward on the last model token the advantage of model token t is ``R - V(s_t)``, and the
  values the critic outputs on feedback tokens change nothing.
* ``reset`` -- ZeroTIR's script (yyht/openrlhf_async_pipline at 63b6159,
  ``openrlhf/trainer/ppo_utils/experience_maker.py`` ``get_advantages_and_returns`` with
  ``--use_env_mask``): values and rewards are zeroed on feedback tokens and the running advantage
  is multiplied by the mask at every token (``lastgaelam *= env_mask[:, t]``), so a feedback
  token ends the episode for the model tokens before it: the next value there is 0 and nothing
  of later turns flows back. With ``gamma = lam = 1`` and no KL term, every model token of an
  earlier turn gets ``A = -V(s_t)`` and return 0; only the last turn sees the outcome.

Shapes: ``B`` rows, ``T`` tokens (the log-prob columns: position t scores token t + 1 of the
row, exactly as the policy's log-probs; the values are aligned the same way).
"""

from __future__ import annotations

import torch

GAE_ACROSS_FEEDBACK = ("carry", "reset")  # critic.gae_across_feedback: verl's multi-turn GAE | ZeroTIR's script


def last_token_index_B(mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of the last model token of each row (-1 for a row without one)."""
    T = mask_BT.shape[1]
    pos_T = torch.arange(T, device=mask_BT.device)
    return torch.where(mask_BT > 0, pos_T, torch.full_like(pos_T, -1)).amax(dim=1)


def token_rewards_BT(rewards_B: torch.Tensor, mask_BT: torch.Tensor, *, logprobs_BT: torch.Tensor | None = None,
                     ref_logprobs_BT: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards: the outcome reward on each row's last model token, plus (KL in the
    reward, OpenRLHF / ZeroTIR) ``-kl_coef * k1`` on every model token, ``k1 = logp - logp_ref``
    of the behaviour policy against the frozen reference. Zero outside ``mask_BT``."""
    mask_BT = mask_BT.float()
    out_BT = torch.zeros_like(mask_BT)
    last_B = last_token_index_B(mask_BT)
    rows = last_B >= 0
    out_BT[rows.nonzero().flatten(), last_B[rows]] = rewards_B.float()[rows]
    if kl_coef:
        if logprobs_BT is None or ref_logprobs_BT is None:
            raise ValueError("KL in the reward needs the behaviour and the reference log-probs")
        out_BT = out_BT - kl_coef * (logprobs_BT.float() - ref_logprobs_BT.float()) * mask_BT
    return out_BT


def gae_BT(token_rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, *, gamma: float = 1.0,
           lam: float = 1.0, across_feedback: str = "carry") -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages_BT, returns_BT)`` by generalised advantage estimation over model tokens only.

    ``carry``: for model tokens t < t' adjacent among model tokens (any feedback between them skipped)::

        delta_t = r_t + gamma * V(t') - V(t)          (V after the last model token: 0)
        A_t     = delta_t + gamma * lam * A_t'
        R_t     = A_t + V(t)

    ``reset``: the same with t' = t + 1 only when it is a model token; a model token followed by a
    feedback token (or by nothing) has ``V(t') = 0`` and ``A_t' = 0``.
    Both are 0 outside ``mask_BT``; the advantages are not whitened (the caller decides).
    """
    if across_feedback not in GAE_ACROSS_FEEDBACK:
        raise ValueError(f"across_feedback must be one of {', '.join(GAE_ACROSS_FEEDBACK)}, got {across_feedback!r}")
    assert token_rewards_BT.shape == values_BT.shape == mask_BT.shape and mask_BT.dim() == 2
    mask_BT = mask_BT.float()
    values_BT = values_BT.float() * mask_BT
    rewards_BT = token_rewards_BT.float()
    B, T = mask_BT.shape
    next_value_B = torch.zeros(B, dtype=torch.float32, device=mask_BT.device)
    last_adv_B = torch.zeros_like(next_value_B)
    adv_BT = torch.zeros_like(mask_BT)
    for t in range(T - 1, -1, -1):
        m_B = mask_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * last_adv_B
        if across_feedback == "carry":  # on a model token: take the new values; elsewhere carry the old ones across
            last_adv_B = m_B * adv_B + (1 - m_B) * last_adv_B
            next_value_B = m_B * values_BT[:, t] + (1 - m_B) * next_value_B
        else:  # reset: every other token zeroes both (its value is 0 and lastgaelam *= mask)
            last_adv_B = m_B * adv_B
            next_value_B = values_BT[:, t]
        adv_BT[:, t] = m_B * adv_B
    returns_BT = (adv_BT + values_BT) * mask_BT
    return adv_BT, returns_BT


def value_loss_BT(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, *,
                  clip: float | None, clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss (PPO, as OpenRLHF's ``ValueLoss``) and the clip indicator::

        v_clip = old + clamp(v - old, -clip, clip_high)          (clip_high None: clip)
        l      = 0.5 * max((v - R)^2, (v_clip - R)^2)        (clip None: 0.5 * (v - R)^2)

    ``clip_high`` other than ``clip``: the asymmetric clip of ZeroTIR's fork (``--value_clip 0.2``,
    ``--value_clip_high 0.28``). The caller aggregates over the model-token mask (value masking)."""
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        return 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT)
    v_clip_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip if clip_high is None else clip_high)
    clipped_BT = (v_clip_BT - returns_BT) ** 2
    return 0.5 * torch.maximum(unclipped_BT, clipped_BT), (clipped_BT > unclipped_BT).float().detach()


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over the mask (1: perfect, 0: no better than the mean, < 0: worse);
    NaN where the returns do not vary (``Var[R] = 0``: nothing to explain, e.g. one row left)."""
    m = mask_BT.float()
    n = m.sum().clamp(min=1)

    def var(x):
        mean = (x * m).sum() / n
        return (((x - mean) * m) ** 2).sum() / n

    var_r = var(returns_BT.float())
    if not var_r > 0:
        return torch.tensor(float("nan"))
    return 1 - var(returns_BT.float() - values_BT.float()) / var_r
