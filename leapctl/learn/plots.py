"""PNG figures at the end of a run: where the budget went (density per decoder block against the
target, the paper's allocation figure) and how training went (loss terms, density, temperature)."""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_density_per_block(density: list[float], target: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(density) + 2), 3.5))
    ax.bar(range(len(density)), density, color="tab:blue", label="learned mask")
    ax.axhline(target, color="tab:red", linestyle="--", label=f"budget {target:.2f}")
    ax.set_xlabel("decoder block")
    ax.set_ylabel("density (kept fraction)")
    ax.set_ylim(0, 1)
    ax.set_title("LEAP: density per block")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_losses(metrics: list[dict], path: Path) -> None:
    plt = _pyplot()
    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    axes[0].plot(steps, [m["lm_loss"] for m in metrics], label="LM loss")
    axes[0].plot(steps, [m["loss"] for m in metrics], label="total loss", alpha=0.7)
    axes[0].set_xlabel("step")
    axes[0].legend()
    axes[0].set_title("loss")
    axes[1].plot(steps, [m["density"] for m in metrics], color="tab:green")
    axes[1].set_xlabel("step")
    axes[1].set_title("soft mask density (with noise)")
    axes[2].plot(steps, [m["density_penalty"] for m in metrics], label="density penalty")
    axes[2].plot(steps, [m["magnitude_penalty"] for m in metrics], label="magnitude term")
    axes[2].set_xlabel("step")
    axes[2].legend()
    axes[2].set_title("regularisers")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curve(values: list[float], xlabel: str, ylabel: str, title: str, path: Path) -> None:
    """One training curve (for example `quantize`'s scale tuning: KL per step)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(values)), values, color="tab:blue")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
