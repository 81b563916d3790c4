#pragma once
// Run directories of flame-diffusion (Note [Run directories] in run_dir.cpp): what counts as a run,
// the refusal to train into one without --resume or --overwrite, what --overwrite removes, and the
// checkpoint files --resume tries.
#include <string>
#include <vector>

namespace flame_diffusion {

// The files of `out` that the trainer writes (paths relative to `out`, sorted): checkpoints/ckpt-
// <step>.safetensors and their temporaries, loss.csv, loss.rank<N>.csv, loss.png, samples.png,
// lora.safetensors and the .tmp files of those writes. Nothing else in `out` is listed.
std::vector<std::string> run_files(const std::string& out);

// Before a train or finetune run (`command`) into `out`: when `out` holds a run (any run_files),
// raises unless resume or overwrite; with overwrite removes exactly those files (and the
// checkpoints folder when that leaves it empty) and says so on stderr.
void prepare_run_dir(const std::string& out, bool resume, bool overwrite, const std::string& command);

// The checkpoint files of a run's checkpoints folder (ckpt-<10 digits>.safetensors), newest (highest
// step) first; temporaries and other files are not listed. Empty when the folder is missing.
std::vector<std::string> checkpoint_files(const std::string& checkpoints_dir);

}  // namespace flame_diffusion
