"""Draw docs/vae_layouts.png: the height-sharded Wan VAE decode (rows per rank through the decoder's stages, the
halo rows of one 3x3 convolution) and the disaggregated DiT / VAE timeline. A schematic of what
diffusers_nki.vae_parallel implements (no measured numbers in it).

    python scripts/plot_vae_layouts.py [--out docs/vae_layouts.png]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from diffusers_nki.vae_parallel import split_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("docs", "vae_layouts.png"))
    args = ap.parse_args(argv)

    h, world = 7, 3
    rows = split_rows(h, world)
    colors = ["#4c78a8", "#f58518", "#54a24b"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1.15, 1]})

    # left: rows of each rank at the stages x1, x2, x4, x8 (drawn to scale within a stage), one conv's halo
    x = 0.0
    for s in (1, 2, 4, 8):
        total = h * s
        y = 0.0
        for r, n in enumerate(rows):
            ax1.add_patch(Rectangle((x, 1 - (y + n * s) / total), 0.8, n * s / total, color=colors[r], alpha=0.8))
            ax1.text(x + 0.4, 1 - (y + n * s / 2) / total, f"rank {r}\n{n * s} rows", ha="center", va="center",
                     fontsize=7, color="white")
            y += n * s
        ax1.text(x + 0.4, 1.04, f"stage x{s}\n{total} rows", ha="center", fontsize=8)
        x += 1.0
    # one 3x3 conv of rank 1 at stage x1: its rows plus one halo row from each neighbour
    x0, s, total = 4.3, 1, h
    start = rows[0]
    ax1.add_patch(Rectangle((x0, 1 - (start + rows[1]) / total), 0.8, rows[1] / total, color=colors[1], alpha=0.8))
    ax1.add_patch(Rectangle((x0, 1 - start / total), 0.8, 1 / total, color=colors[0], alpha=0.5, hatch="//"))
    ax1.add_patch(Rectangle((x0, 1 - (start + rows[1] + 1) / total), 0.8, 1 / total, color=colors[2], alpha=0.5,
                            hatch="//"))
    ax1.text(x0 + 0.4, 1 - (start - 0.5) / total, "halo: rank 0's\nlast row", ha="center", va="center", fontsize=7)
    ax1.text(x0 + 0.4, 1 - (start + rows[1] + 1.5) / total, "halo: rank 2's\nfirst row", ha="center", va="center",
             fontsize=7)
    ax1.text(x0 + 0.4, 1.04, "rank 1, one\n3x3 conv input", ha="center", fontsize=8)
    ax1.set_xlim(-0.1, 5.3)
    ax1.set_ylim(-0.02, 1.14)
    ax1.axis("off")
    ax1.set_title(f"Height split: latent height {h} over {world} ranks (rows {rows}), halo rows per 3x3 conv;\n"
                  "the mid attention all-gathers keys/values, the output rows are all-gathered", fontsize=9)

    # right: disaggregated timeline (DiT denoises chunk i+1 while the VAE decodes chunk i)
    t_dit, t_vae, n = 1.0, 0.8, 5
    for i in range(n):
        ax2.add_patch(Rectangle((i * t_dit, 1.1), t_dit * 0.95, 0.5, color="#4c78a8"))
        ax2.text(i * t_dit + 0.47, 1.35, f"denoise {i}", ha="center", va="center", fontsize=7, color="white")
        start = (i + 1) * t_dit + 0.05
        ax2.add_patch(Rectangle((start, 0.3), t_vae, 0.5, color="#f58518"))
        ax2.text(start + t_vae / 2, 0.55, f"decode {i}", ha="center", va="center", fontsize=7, color="white")
        ax2.annotate("", xy=(start, 0.8), xytext=((i + 1) * t_dit - 0.05, 1.1),
                     arrowprops=dict(arrowstyle="->", lw=0.8))
        ax2.text(start + t_vae, 0.15, f"frames {i}", ha="right", fontsize=6)
    ax2.text(-0.1, 1.35, "DiT ranks\n[0, w_dit)", ha="right", va="center", fontsize=8)
    ax2.text(-0.1, 0.55, "VAE ranks\n[w_dit, W)", ha="right", va="center", fontsize=8)
    ax2.set_xlim(-1.2, n * t_dit + 1.0)
    ax2.set_ylim(0, 1.9)
    ax2.axis("off")
    ax2.set_title("Disaggregated: the leader sends each chunk's latents (arrow) and goes on;\n"
                  "per chunk max(t_dit, t_vae) + one transfer once the pipeline fills", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
