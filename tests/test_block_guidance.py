"""block_guidance: what a model's KV block takes in host pages, and the page size that fits it."""

from __future__ import annotations

from tiercache.layout import BlockLayout, block_guidance


def test_real_models_fit_the_default_page_exactly() -> None:
    for layout, size, pages in ((BlockLayout(12, 12, 64, 16, "float32"), 1179648, 18),  # GPT-2-small
                                (BlockLayout(32, 8, 128, 16, "float16"), 2097152, 32),  # Llama-3-8B
                                (BlockLayout(28, 4, 128, 16, "bfloat16"), 917504, 14)):  # Qwen2.5-7B
        line = block_guidance(layout, 64 << 10)
        assert f"= {size} bytes" in line and f"it takes {pages}: fits exactly" in line, line


def test_a_block_that_wastes_its_pages_gets_the_page_size_that_fits() -> None:
    line = block_guidance(BlockLayout(22, 4, 64, 16, "float16"), 64 << 10)  # TinyLlama: 352 KiB
    assert "it takes 6: wastes 32768 bytes a block (8%); host.page_bytes = 32768 wastes 0%" in line, line
    line = block_guidance(BlockLayout(5, 3, 24, 7, "float32"), 64 << 10)  # 20160 bytes: no power of two divides
    assert "wastes 45376 bytes a block (69%); host.page_bytes = 4096 wastes 2%" in line, line
