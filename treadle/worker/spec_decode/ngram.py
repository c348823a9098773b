"""N-gram ("prompt lookup") drafts: if the sequence's last n tokens occurred earlier, propose
the tokens that followed them then.

The longest n in [min_n, max_n] with an earlier occurrence wins, and among occurrences the
earliest. Example: [1, 2, 3, 4, 1, 2, 3] with n = 2 and k = 3 proposes [4, 1, 2].
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.min_n = min_n
        self.max_n = max_n
        self.k = num_speculative_tokens

    def propose(self, token_ids: np.ndarray) -> list[int]:
        """Up to k drafts to follow `token_ids` (prompt and output so far); [] when no match."""
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            # Windows that start early enough to be followed by at least one token.
            windows = sliding_window_view(token_ids[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return token_ids[start:start + self.k].tolist()
        return []
