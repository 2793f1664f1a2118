"""Rejection sampling of proposed tokens: which prefix of a request's drafts the target keeps.

The proposers here are deterministic (n-gram lookup; a draft model decoding greedily), so the
draft distribution q is one-hot on each draft token d. Leviathan et al.'s rule (vLLM's
rejection sampler with `draft_probs=None`) then reads: accept d with probability
min(1, p(d) / q(d)) = p(d); on rejection, emit a token drawn from norm(max(p - q, 0)), which
is p with d removed, renormalized; after k accepted drafts, emit a bonus token drawn from p.
Drawing x ~ p at every position and accepting d exactly when x == d is the same law: d is
kept with probability p(d), and a rejected position emits x ~ p conditioned on x != d. So
the target samples one token per position with its own sampler (temperature, top-k/p,
min-p, logit_bias and per-request seeds all apply unchanged) and the drafts are compared to
those tokens; greedy requests are the special case p = one-hot argmax. Every emitted token
is a draw from the target's distribution given the accepted prefix: the output follows the
target exactly, greedy output is identical to decoding without speculation.
"""

from __future__ import annotations


def num_accepted(draft_token_ids: list[int], target_token_ids: list[int]) -> int:
    """How many leading drafts the target kept. `target_token_ids` holds the target's token
    at every draft position plus one (the bonus); the request emits
    `target_token_ids[: num_accepted + 1]` (the accepted drafts, then the target's token)."""
    if len(target_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(
            f"{len(draft_token_ids)} drafts need {len(draft_token_ids) + 1} target tokens, "
            f"got {len(target_token_ids)}"
        )
    accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted
