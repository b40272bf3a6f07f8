"""Speculative decoding: proposers (draft model, n-gram), lossless verification, adaptive depth.

Vocabulary, used the same way everywhere in this package:

- **draft tokens** x_1..x_k: what a proposer guesses will follow a sequence, with the
  distributions q_1..q_k they were drawn from (one-hot for n-gram proposals).
- **verification**: the target scores the k + 1 positions (last token, x_1..x_k) in one forward
  pass, giving p_1..p_{k+1}; p and q are both after the request's own sampling parameters.
- **accepted**: x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the
  first rejection.
- **recovered** token: at the first rejection, a token drawn from norm(max(0, p_i − q_i)).
- **bonus** token: when all k are accepted, a token drawn from p_{k+1}.

Every step thus yields (accepted + 1) tokens, distributed exactly as plain sampling from the
target would give them.
"""
