"""`paro`: the command line. Each command is a thin wrapper; the work lives in the modules it names."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="PAROAttention for diffusers video and image models.")


@app.callback()
def main() -> None:
    """PAROAttention for diffusers: calibrate a plan, inspect it, generate and benchmark with it."""


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@app.command()
def inspect(
    plan_path: Path = typer.Argument(..., help="plan file written by `paro calibrate`"),
    png: Path | None = typer.Option(None, "--png", help="also draw block maps and masks as PNGs into this folder"),
    heads: str = typer.Option("0:0,0:1", help="layer:head pairs to draw with --png"),
) -> None:
    """Print a readable summary of a plan."""
    from .errors import PlanError
    from .plan import Plan
    from .summary import describe_plan

    try:
        plan = Plan.load(plan_path)
    except PlanError as exc:
        _fail(str(exc))
    typer.echo(describe_plan(plan, size_on_disk=plan_path.stat().st_size))
    if png is not None:
        from .calibrate.figures import draw_plan_heads

        pairs = [tuple(int(x) for x in pair.split(":")) for pair in heads.split(",") if pair]
        for path in draw_plan_heads(plan, pairs, png):
            typer.echo(f"wrote {path}")


if __name__ == "__main__":
    app()
