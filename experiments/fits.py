"""The cost model's fits of measured times, t(b) = alpha + b * beta (Hockney), for the
calibration inside a host (calibrate.py), of psrv (calibrate_ps.py) and of the link
between hosts (calibrate_link.py)."""
import numpy as np

LARGE = 1 << 20            # the per-byte fits use sizes from here up


def fit_alpha_beta(nbytes, seconds):
    """Least squares of t = alpha + b * beta, each point weighted by 1/t, so that
    the small sizes (alpha) count as much as the large ones (beta)."""
    b, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    A = np.stack([np.ones_like(b), b], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    return max(float(alpha), 0.0), float(beta)


def fit_beta(nbytes, seconds, alpha):
    """Least squares of t = alpha + b * beta for beta, alpha fixed, each point weighted
    by 1/t (fit_alpha_beta's weights)."""
    b, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    return float(np.sum((t - alpha) * b / t**2) / np.sum(b**2 / t**2))


def fit_two_regimes(nbytes, seconds, split=LARGE):
    """alpha from the messages below `split`, beta from those at or above it.
    Why not one fit: caches make a byte cost about twice as much at 16 MiB as at
    4 MiB here, so one line through 4 KiB..32 MiB misses both ends; the model's
    fidelity target is about messages >= 1 MiB, so beta is fitted there."""
    small = [(b, t) for b, t in zip(nbytes, seconds) if b < split]
    large = [(b, t) for b, t in zip(nbytes, seconds) if b >= split]
    alpha, _ = fit_alpha_beta(*zip(*small)) if len(small) >= 2 else (0.0, 0.0)
    return alpha, fit_beta(*zip(*large), alpha)
