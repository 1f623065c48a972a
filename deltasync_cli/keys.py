"""``deltasync keygen``: the key pair that signs a stream's steps (docs/FORMAT.md section 5e)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deltasync_cli.app import command, out


@command(summary="Make a key pair that signs a stream's steps.",
         examples=["deltasync keygen trainer.key",
                   "deltasync keygen trainer-2.key --endorsed-by trainer.key --from-step 500",
                   "deltasync keygen export.key --ecdsa"])
def keygen(
    path: Annotated[Path, typer.Argument(metavar="PATH",
                                   help="Where to write the private key (mode 0600); its public half goes to "
                                        "PATH.pub. Never overwrites.")],
    endorsed_by: Annotated[Path | None, typer.Option("--endorsed-by", metavar="PATH",
                                                help="The current signing key: it endorses the "
                                                     "new one (PATH.endorsement.json), so followers that trust it "
                                                     "accept steps the new key signs (key rotation).")] = None,
    from_step: Annotated[int, typer.Option("--from-step", min=0, metavar="STEP",
                                      help="With --endorsed-by: the first step the new key "
                                           "signs; the old key is refused from there on.")] = 0,
    ecdsa: Annotated[bool, typer.Option("--ecdsa", help="An ECDSA P-256 key for signing exported checkpoints "
                                        "(replay --sign), which OpenSSF model_signing verifies.")] = False,
) -> None:
    """Make an Ed25519 key pair for signing steps: the trainer gets the private key (DeltaPublisher(...,
    signing_key=PATH)), followers the public one (--trusted-key PATH.pub, Follower(..., trusted_keys=[...]))."""
    from deltasync.signing import keygen as make

    private, public = make(path, endorsed_by=endorsed_by, from_step=from_step, ecdsa=ecdsa)
    out.print(f"private key {private} (mode 0600: keep it with the trainer, never in the store); public key {public} "
              f"(give it to followers)" + (f"; endorsed by {endorsed_by} from step {from_step}" if endorsed_by else ""),
              markup=False, soft_wrap=True)
