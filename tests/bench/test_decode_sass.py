"""The static SASS count of the decode kernels: the loop is found by its backward branch and cut
at the forward branches inside it, a skippable region counted apart."""

from __future__ import annotations

import pytest

from bench.kernels.decode_sass import instructions, main_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0030*/                   ISETP.NE.AND P0, PT, R2, RZ, PT ;
        /*0040*/              @!P0 BRA 0x80 ;
        /*0050*/                   PRMT R3, R2, 0x5410, R2 ;
        /*0060*/                   PRMT R5, R2, 0x7632, R2 ;
        /*0070*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0080*/                   FMUL R9, R8, R8 ;
        /*0090*/                   ISETP.GE.AND P1, PT, R0, 0x10, PT ;
        /*00a0*/              @!P1 BRA 0x20 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
"""


def test_the_loop_and_its_skippable_region() -> None:
    loop = main_loop(instructions(SASS))
    assert (loop["start"], loop["end"]) == ("0x20", "0xa0")
    regions = [(r["from"], r["instructions"], r["skippable"]) for r in loop["regions"]]
    assert regions == [("0x20", 3, False), ("0x50", 3, True), ("0x80", 3, False)]
    assert loop["regions"][1]["top"] == {"PRMT": 2, "HMMA": 1}


def test_no_loop_is_an_error() -> None:
    with pytest.raises(ValueError, match="no loop"):
        main_loop(instructions("        /*0000*/                   EXIT ;\n"))


@pytest.mark.slow
def test_the_staged_decode_compiles_and_its_loop_is_counted() -> None:
    """Compiles the default staged decode for sm_90 (about 5 s): a loop of four skippable
    regions (codes' K, FP8 K, codes' V, FP8 V)."""
    pytest.importorskip("triton")
    from bench.kernels.decode_sass import VARIANTS, analyse

    result = analyse("default", VARIANTS["default"])
    skippable = [r for r in result["loop"]["regions"] if r["skippable"]]
    assert len(skippable) == 4
    assert result["registers"] <= 255 and result["ctas_per_sm"] >= 1
