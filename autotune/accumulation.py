"""Exact gradient accumulation: the applied gradient is the gradient of the whole window.

Every micro-batch's backward runs on its *summed* loss times ``world_size / window_samples``:

* a mean loss over n samples becomes ``mean * n``, so micro-batch i weighs ``n_i / N`` and the
  window's gradient is the large-batch mean, whatever the sizes (uneven plans, a partial last
  window normalised by its own N); never ``1 / accumulation_steps``;
* DDP averages gradients over ranks, which the ``world_size`` factor undoes;
* a ``(loss_sum, item_count)`` loss (tokens, say) cannot be normalised before backward, because
  the window's item count is known only once every micro-batch has run (on every rank). It is
  backpropagated with the same per-sample scale, and the accumulated gradient is multiplied once
  by ``N / C`` after the window's count C has been all-reduced: the result is sum / C exactly.
"""

from __future__ import annotations

import torch


def backward_scale(*, world_size: int, window_samples: int) -> float:
    """The factor each micro-batch's summed loss is multiplied by before backward."""
    return world_size / window_samples


def summed_loss(loss: torch.Tensor, count, samples: int):
    """``(loss_sum, item_count)`` for a micro-batch: a mean loss is turned into its sum."""
    if count is None:
        return loss * samples, samples
    return loss, count


def count_correction(*, window_samples: int, window_items) -> float:
    """The factor that turns per-sample-scaled sums into a mean over the window's items."""
    return window_samples / float(window_items)


def scale_gradients(params, factor: float) -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


COUNTED_RANKS = 6
"""Where ``WindowTotals.as_tensor`` holds how many ranks counted items (a (loss_sum, count) loss)."""


class WindowTotals:
    """The window's summed loss and item count, kept on the device until the step ends.

    Converting to Python numbers once per window, not per micro-batch, avoids a device sync per
    micro-step.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.items = torch.zeros((), dtype=torch.float64, device=self.device)
        self.token_counts = False
        # The gradient noise scale's small batch (see ``autotune.training.noise_scale``): this rank's
        # per-sample |G_small|², 1/B_small, and 1 when the rank measured it (summed over ranks).
        self.small_sq_norm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.small_inverse_batch = 0.0
        self.small_ranks = 0.0

    def add(self, loss_sum: torch.Tensor, count, *, counted: bool) -> None:
        self.loss_sum += loss_sum.detach().to(torch.float64)
        self.items += count.detach().to(torch.float64) if isinstance(count, torch.Tensor) else float(count)
        self.token_counts = self.token_counts or counted

    def add_small_batch(self, sq_norm: torch.Tensor, batch: int) -> None:
        self.small_sq_norm = sq_norm.detach().to(torch.float64)
        self.small_inverse_batch = 1.0 / batch
        self.small_ranks = 1.0

    def as_tensor(self, stop: bool) -> torch.Tensor:
        """[loss_sum, items, stop flag, small |G|², 1/B_small, ranks measured, ranks that counted
        items]: what ranks all-reduce once per window (the noise-scale terms ride along for free;
        a pipeline's items are counted on its last stage only, and every stage learns of them)."""
        extra = torch.tensor([1.0 if stop else 0.0, 0.0, self.small_inverse_batch, self.small_ranks,
                              1.0 if self.token_counts else 0.0],
                             dtype=torch.float64, device=self.device)
        extra[1] = self.small_sq_norm
        return torch.cat([torch.stack([self.loss_sum, self.items]), extra])
