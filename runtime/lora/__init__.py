"""Multi-LoRA serving's runtime side (torch-free): adapters read as PEFT publishes them
(peft_dir.py), checked against a plan's adapter tables and written into a slot (tables.py), and
the slots shared by the requests that name adapters (slots.py). The plan's side is
compiler/passes/add_lora.py."""
