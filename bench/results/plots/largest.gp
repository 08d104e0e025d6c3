set terminal pngcairo noenhanced size 1000,560 font 'DejaVu Sans,10'
set output '../largest.png'
set title 'Largest-model search, world 4: peak resident memory per rank (max over ranks) per probe'
set xlabel 'parameters (millions)'
set ylabel 'peak RSS per rank (MiB)'
set logscale x
set grid
set key left top
plot 'largest.dat' index 0 using 1:2 with linespoints pt 7 title 'NO_SHARD (whole, malloc default)', 'largest.dat' index 1 using 1:2 with linespoints pt 7 title 'FULL_SHARD (whole, malloc default)', 'largest.dat' index 2 using 1:2 with linespoints pt 7 title 'NO_SHARD (steps, malloc default)', 'largest.dat' index 3 using 1:2 with linespoints pt 7 title 'FULL_SHARD (steps, malloc default)', 'largest.dat' index 4 using 1:2 with linespoints pt 7 title 'NO_SHARD (whole, malloc mmap)', 'largest.dat' index 5 using 1:2 with linespoints pt 7 title 'FULL_SHARD (whole, malloc mmap)', 'largest.dat' index 6 using 1:2 with linespoints pt 7 title 'NO_SHARD (steps, malloc mmap)', 'largest.dat' index 7 using 1:2 with linespoints pt 7 title 'FULL_SHARD (steps, malloc mmap)', 1024 with lines lw 2 lc 'black' dt 2 title 'cap (1024 MiB)'
