/* commands.h: the CLI's commands, one file each (tools/bench_*.c), which tools/flywheel.c
 * dispatches to. Each takes the arguments after its name and returns the exit status. */
#ifndef FW_COMMANDS_H
#define FW_COMMANDS_H

/* bench_*_main: `flywheel bench NAME ...`. bench_*_headline: that kernel's part of `flywheel
 * run`, checked against the float64 reference (nonzero: a check failed); json: one JSON
 * object a line and no captions; small: `run --small`, the same calls on shapes a quarter of
 * the heads and a sixteenth of the tokens, once each (for emulators and slow machines: their
 * checks, not their speed). */
int bench_attn_main(int argc, char **argv);
int bench_attn_headline(int json, int small);
int bench_kvcache_main(int argc, char **argv);
int bench_kvcache_headline(int json, int small);
int bench_gdn_main(int argc, char **argv);
int bench_gdn_headline(int json, int small);
int bench_conv_main(int argc, char **argv);
int bench_conv_headline(int json, int small);
int bench_threads_main(int argc, char **argv);
/* argv: A.so B.so decode|gdn [options] */
int bench_ab_main(int argc, char **argv);

#endif
