"""Entry point: the ``meshllm`` command group; each subcommand lives in its own module."""

from __future__ import annotations

import click

from meshllm import __version__
from meshllm.cli.common import MeshllmGroup


@click.group(cls=MeshllmGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="meshllm")
def cli() -> None:
    """meshllm: pool spare machines into one OpenAI-compatible LLM service."""


def _register() -> None:
    """Attach the subcommands (imported here so ``meshllm --version`` stays fast)."""
    from meshllm.cli import (
        auth,
        blackboard,
        chat,
        console,
        discover,
        doctor,
        invite,
        launch,
        mesh,
        models,
        owner,
        plan,
        publish,
        serve,
        service,
        status,
    )

    cli.add_command(auth.auth)
    cli.add_command(mesh.mesh)
    cli.add_command(invite.invite)
    cli.add_command(status.status)
    cli.add_command(plan.plan)
    cli.add_command(models.models)
    cli.add_command(owner.owner)
    cli.add_command(serve.serve)
    cli.add_command(serve.join)
    cli.add_command(publish.publish)
    cli.add_command(discover.discover)
    cli.add_command(console.console)
    cli.add_command(launch.launch)
    cli.add_command(chat.chat)
    cli.add_command(service.service)
    cli.add_command(doctor.doctor)
    cli.add_command(blackboard.blackboard)


def main() -> None:
    """Console-script entry point."""
    _register()
    cli(prog_name="meshllm")


if __name__ == "__main__":
    main()
