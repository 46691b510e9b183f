"""What an engine settles from its machine and its model's folder, outside the step's core: the
packaged default model's names (default_model), the dtype `--dtype auto` picks (dtype_choice), the
model's sampling defaults (generation_config), the bounds on native memory (native_memory) and the
folder for what is built once and reused (cache_dir)."""
