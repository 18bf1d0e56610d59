/* commands.h: the CLI's commands, one file each (tools/bench_*.c), which tools/flywheel.c
 * dispatches to. Each takes the arguments after its name and returns the exit status. */
#ifndef FW_COMMANDS_H
#define FW_COMMANDS_H

int bench_attn_main(int argc, char **argv);
int bench_attn_headline(void);
int bench_kvcache_main(int argc, char **argv);
int bench_kvcache_headline(void);
int bench_gdn_main(int argc, char **argv);
int bench_gdn_headline(void);
int bench_conv_main(int argc, char **argv);
int bench_conv_headline(void);
int bench_threads_main(int argc, char **argv);
/* argv: A.so B.so decode|gdn [options] */
int bench_ab_main(int argc, char **argv);

#endif
