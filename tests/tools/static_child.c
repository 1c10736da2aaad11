/* A statically linked program: LD_PRELOAD cannot load libheapdump.so into it, so `heapdump run`
 * must say so as soon as it exits. Exits with status 4. */
int main(void) { return 4; }
