"""STaR: the loop (`loop.run`), collection of kept and rationalised
rationales (`collect`), and the supervised fine-tuning step (`sft`)."""
